// Collectives in numbered steps through each rank's staging area. Every rank runs the same
// steps: stage its part, wait until all have staged, combine what it needs from every staging
// area into its output, then mark the step consumed.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "comm/shm/tasks.hpp"
#include "common/error.hpp"

namespace megart::comm::shm {

namespace {

std::uint64_t mix(std::uint64_t h, std::uint64_t x) {
  h ^= x + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  return h;
}

class Staged : public Task {
 public:
  bool collective() const override { return true; }

  bool step(ShmCommunicator& c) override {
    if (!started_) {
      total_ = steps(c);
      first_ = c.reserve_steps(total_);
      started_ = true;
    }
    const int n = c.size();
    while (k_ < total_) {
      const std::uint64_t s = first_ + k_;
      if (!staged_) {
        // The half this step uses was last read in step s - 2: wait until all have read it.
        if (s > 2 && lagging(c, &RankSlot::consumed, s - 2) >= 0) return false;
        stage(c, k_, c.layout().staging(c.base(), c.rank(), s));
        c.slot(c.rank())->signature[s % 2].store(signature(), std::memory_order_relaxed);
        c.slot(c.rank())->staged.store(s, std::memory_order_release);
        c.signal();
        staged_ = true;
        ++moved;
      }
      if (lagging(c, &RankSlot::staged, s) >= 0) return false;
      std::vector<const std::uint8_t*> parts(n);
      for (int q = 0; q < n; ++q) {
        if (c.slot(q)->signature[s % 2].load(std::memory_order_relaxed) != signature()) {
          throw CommError("rank " + std::to_string(q) + " is in another collective than " +
                          describe() +
                          " (or the same one with other sizes): every rank of a group must "
                          "call the same collectives in the same order with the same sizes");
        }
        parts[q] = c.layout().staging(c.base(), q, s);
      }
      combine(c, k_, parts);
      c.slot(c.rank())->consumed.store(s, std::memory_order_release);
      c.signal();
      staged_ = false;
      ++k_;
      ++moved;
    }
    return true;
  }

  std::vector<int> waiting_on(const ShmCommunicator& c) const override {
    std::vector<int> out;
    if (!started_) {
      // Queued behind an earlier collective: it will need every rank (its steps are not
      // numbered yet, so no counter says who is behind).
      for (int q = 0; q < c.size(); ++q) {
        if (q != c.rank()) out.push_back(q);
      }
      return out;
    }
    const std::uint64_t s = first_ + k_;
    for (int q = 0; q < c.size(); ++q) {
      const RankSlot* slot = c.slot(q);
      const bool behind =
          staged_ ? slot->staged.load() < s : (s > 2 && slot->consumed.load() < s - 2);
      if (behind) out.push_back(q);
    }
    return out;
  }

 protected:
  virtual std::uint64_t steps(const ShmCommunicator& c) const = 0;
  virtual void stage(const ShmCommunicator& c, std::uint64_t k, std::uint8_t* dst) = 0;
  virtual void combine(const ShmCommunicator& c, std::uint64_t k,
                       const std::vector<const std::uint8_t*>& parts) = 0;
  virtual std::uint64_t signature() const = 0;

  static std::uint64_t ceil_div(std::uint64_t a, std::uint64_t b) { return (a + b - 1) / b; }

 private:
  // The first rank whose counter is below `at_least`, or -1.
  static int lagging(const ShmCommunicator& c, std::atomic<std::uint64_t> RankSlot::* counter,
                     std::uint64_t at_least) {
    for (int q = 0; q < c.size(); ++q) {
      if ((c.slot(q)->*counter).load(std::memory_order_acquire) < at_least) return q;
    }
    return -1;
  }

  bool started_ = false;
  bool staged_ = false;
  std::uint64_t first_ = 0;
  std::uint64_t total_ = 0;
  std::uint64_t k_ = 0;
};

// The elements of one buffer handled in step k when each step takes `per_step`.
struct Piece {
  std::uint64_t offset;
  std::uint64_t count;
};
Piece piece(std::uint64_t k, std::uint64_t per_step, std::uint64_t total) {
  const std::uint64_t offset = k * per_step;
  return {offset, std::min(per_step, total - offset)};
}

std::string shape(const Buffer& b) { return std::to_string(b.count) + " x " + dtype_name(b.dtype); }

std::uint8_t* at(const Buffer& b, std::uint64_t element) {
  return static_cast<std::uint8_t*>(b.data) + element * dtype_size(b.dtype);
}

// Copies the piece of `b` starting at element `offset` into or out of a staging area.
void copy_out(std::uint8_t* dst, const Buffer& b, std::uint64_t offset, std::uint64_t count) {
  std::memcpy(dst, at(b, offset), count * dtype_size(b.dtype));
}
void copy_in(const Buffer& b, std::uint64_t offset, const std::uint8_t* src, std::uint64_t count) {
  std::memcpy(at(b, offset), src, count * dtype_size(b.dtype));
}

// A collective that walks `count` elements of one dtype in pieces that fit half a staging area
// (with `slices` pieces side by side: one per rank for reduce-scatter).
class Walk : public Staged {
 protected:
  Walk(std::uint64_t count, DType dtype, bool per_rank_slices)
      : count_(count), dtype_(dtype), per_rank_slices_(per_rank_slices) {}
  virtual void stage(const ShmCommunicator& c, Piece p, std::uint8_t* dst) = 0;
  virtual void combine(const ShmCommunicator& c, Piece p,
                       const std::vector<const std::uint8_t*>& parts) = 0;
  std::uint64_t count_;
  DType dtype_;

 private:
  std::uint64_t per_step(const ShmCommunicator& c) const {
    const std::uint64_t slices = per_rank_slices_ ? c.size() : 1;
    return c.layout().half_staging() / (dtype_size(dtype_) * slices);
  }
  std::uint64_t steps(const ShmCommunicator& c) const override {
    return ceil_div(count_, per_step(c));
  }
  void stage(const ShmCommunicator& c, std::uint64_t k, std::uint8_t* dst) override {
    stage(c, piece(k, per_step(c), count_), dst);
  }
  void combine(const ShmCommunicator& c, std::uint64_t k,
               const std::vector<const std::uint8_t*>& parts) override {
    combine(c, piece(k, per_step(c), count_), parts);
  }
  bool per_rank_slices_;
};

class AllReduce final : public Walk {
 public:
  AllReduce(Buffer b, ReduceOp op) : Walk(b.count, b.dtype, false), b_(b), op_(op) {}
  std::string describe() const override {
    return std::string("all_reduce(") + shape(b_) + ", " + reduce_op_name(op_) + ")";
  }

 private:
  void stage(const ShmCommunicator&, Piece p, std::uint8_t* dst) override {
    copy_out(dst, b_, p.offset, p.count);
  }
  void combine(const ShmCommunicator& c, Piece p,
               const std::vector<const std::uint8_t*>& parts) override {
    std::vector<const void*> srcs(parts.begin(), parts.end());
    reduce(at(b_, p.offset), srcs.data(), c.size(), p.count, dtype_, op_);
  }
  std::uint64_t signature() const override {
    return mix(mix(mix(1, count_), static_cast<int>(dtype_)), static_cast<int>(op_));
  }
  Buffer b_;
  ReduceOp op_;
};

class AllGather final : public Walk {
 public:
  AllGather(Buffer in, Buffer out) : Walk(in.count, in.dtype, false), in_(in), out_(out) {}
  std::string describe() const override { return "all_gather(" + shape(in_) + " per rank)"; }

 private:
  void stage(const ShmCommunicator&, Piece p, std::uint8_t* dst) override {
    copy_out(dst, in_, p.offset, p.count);
  }
  void combine(const ShmCommunicator& c, Piece p,
               const std::vector<const std::uint8_t*>& parts) override {
    for (int q = 0; q < c.size(); ++q) copy_in(out_, q * count_ + p.offset, parts[q], p.count);
  }
  std::uint64_t signature() const override { return mix(mix(2, count_), static_cast<int>(dtype_)); }
  Buffer in_, out_;
};

class ReduceScatter final : public Walk {
 public:
  ReduceScatter(Buffer in, Buffer out, ReduceOp op)
      : Walk(out.count, out.dtype, true), in_(in), out_(out), op_(op) {}
  std::string describe() const override {
    return std::string("reduce_scatter(") + shape(out_) + " per rank, " + reduce_op_name(op_) + ")";
  }

 private:
  void stage(const ShmCommunicator& c, Piece p, std::uint8_t* dst) override {
    // Every rank's slice of this step's piece, one after another.
    const std::size_t bytes = p.count * dtype_size(dtype_);
    for (int q = 0; q < c.size(); ++q)
      copy_out(dst + q * bytes, in_, q * count_ + p.offset, p.count);
  }
  void combine(const ShmCommunicator& c, Piece p,
               const std::vector<const std::uint8_t*>& parts) override {
    const std::size_t bytes = p.count * dtype_size(dtype_);
    std::vector<const void*> srcs;
    for (const std::uint8_t* part : parts) srcs.push_back(part + c.rank() * bytes);
    reduce(at(out_, p.offset), srcs.data(), c.size(), p.count, dtype_, op_);
  }
  std::uint64_t signature() const override {
    return mix(mix(mix(3, count_), static_cast<int>(dtype_)), static_cast<int>(op_));
  }
  Buffer in_, out_;
  ReduceOp op_;
};

class Broadcast final : public Walk {
 public:
  Broadcast(Buffer b, int root) : Walk(b.count, b.dtype, false), b_(b), root_(root) {}
  std::string describe() const override {
    return "broadcast(" + shape(b_) + ", root " + std::to_string(root_) + ")";
  }

 private:
  void stage(const ShmCommunicator& c, Piece p, std::uint8_t* dst) override {
    if (c.rank() == root_) copy_out(dst, b_, p.offset, p.count);
  }
  void combine(const ShmCommunicator& c, Piece p,
               const std::vector<const std::uint8_t*>& parts) override {
    if (c.rank() != root_) copy_in(b_, p.offset, parts[root_], p.count);
  }
  std::uint64_t signature() const override {
    return mix(mix(mix(4, count_), static_cast<int>(dtype_)), root_);
  }
  Buffer b_;
  int root_;
};

class Barrier final : public Staged {
 public:
  std::string describe() const override { return "barrier()"; }

 private:
  std::uint64_t steps(const ShmCommunicator&) const override { return 1; }
  void stage(const ShmCommunicator&, std::uint64_t, std::uint8_t*) override {}
  void combine(const ShmCommunicator&, std::uint64_t,
               const std::vector<const std::uint8_t*>&) override {}
  std::uint64_t signature() const override { return 5; }
};

}  // namespace

std::shared_ptr<Task> make_all_reduce(Buffer inout, ReduceOp op) {
  return std::make_shared<AllReduce>(inout, op);
}
std::shared_ptr<Task> make_all_gather(Buffer in, Buffer out) {
  return std::make_shared<AllGather>(in, out);
}
std::shared_ptr<Task> make_reduce_scatter(Buffer in, Buffer out, ReduceOp op) {
  return std::make_shared<ReduceScatter>(in, out, op);
}
std::shared_ptr<Task> make_broadcast(Buffer inout, int root) {
  return std::make_shared<Broadcast>(inout, root);
}
std::shared_ptr<Task> make_barrier() { return std::make_shared<Barrier>(); }

}  // namespace megart::comm::shm
