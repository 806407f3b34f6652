#include "comm/shm/communicator.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "comm/shm/tasks.hpp"
#include "common/error.hpp"

namespace megart::comm::shm {

namespace {

using Clock = std::chrono::steady_clock;

class ShmWork final : public Work {
 public:
  ShmWork(std::shared_ptr<ShmCommunicator> comm, std::shared_ptr<Task> task)
      : comm_(std::move(comm)), task_(std::move(task)) {}
  bool is_completed() override { return comm_->poll(task_); }
  void wait() override { comm_->wait(task_); }

 private:
  std::shared_ptr<ShmCommunicator> comm_;
  std::shared_ptr<Task> task_;
};

void check_buffer(const Buffer& b, const char* what) {
  if (b.count > 0 && b.data == nullptr) {
    throw ConfigError(std::string(what) + ": a buffer of " + std::to_string(b.count) +
                      " elements has no data");
  }
}

}  // namespace

std::shared_ptr<ShmCommunicator> ShmCommunicator::create(const std::string& shm_name,
                                                         const std::string& group_name, int rank,
                                                         int size, const Options& options,
                                                         std::shared_ptr<ShmCommunicator> board) {
  if (size < 1 || rank < 0 || rank >= size) {
    throw ConfigError("rank " + std::to_string(rank) + " is not in a group of size " +
                      std::to_string(size));
  }
  if (options.staging_bytes < 4096 || options.channel_bytes < 4096) {
    throw ConfigError("shm staging and channel sizes must be at least 4096 bytes");
  }
  for (const std::size_t n :
       {options.pids.size(), options.global_ranks.size(), options.labels.size()}) {
    if (n != 0 && n != static_cast<std::size_t>(size)) {
      throw ConfigError("shm options: pids, global_ranks and labels need one entry per rank");
    }
  }
  const Layout layout(size, options.staging_bytes, options.channel_bytes);
  Segment segment = rank == 0 ? Segment::create(shm_name, layout.total_bytes())
                              : Segment::open(shm_name, layout.total_bytes(), options.timeout,
                                              options.pids.empty() ? 0 : options.pids[0]);
  std::shared_ptr<ShmCommunicator> c(
      new ShmCommunicator(std::move(segment), layout, group_name, rank, size, options));
  c->board_ = std::move(board);
  c->attach();
  return c;
}

namespace {
std::string direct_setting() {
  const char* env = std::getenv("MEGART_SHM_DIRECT");
  return env == nullptr ? "1" : env;
}
}  // namespace

ShmCommunicator::ShmCommunicator(Segment segment, Layout layout, std::string group_name, int rank,
                                 int size, const Options& options)
    : segment_(std::move(segment)),
      layout_(layout),
      header_(layout_.header(segment_.data())),
      group_name_(std::move(group_name)),
      rank_(rank),
      size_(size),
      options_(options),
      spin_(size <= static_cast<int>(std::max(1u, std::thread::hardware_concurrency()))),
      sent_(size),
      direct_(size, direct_setting() != "0"),
      pair_batches_(size, 0),
      refuse_direct_(direct_setting() == "refuse") {}

void ShmCommunicator::attach() {
  if (rank_ == 0) {
    header_->size = static_cast<std::uint32_t>(size_);
    header_->staging_bytes = options_.staging_bytes;
    header_->channel_bytes = options_.channel_bytes;
    header_->aborted_by.store(-1);
    header_->magic.store(kMagic, std::memory_order_release);
  }
  // Every rank knows its peers' process ids (from the rendezvous) before they attach, so a
  // peer that died before attaching is noticed within ~0.1 s rather than at the timeout.
  for (int q = 0; q < static_cast<int>(options_.pids.size()); ++q) {
    if (options_.pids[q] > 0) slot(q)->pid.store(options_.pids[q]);
  }
  const auto deadline = Clock::now() + options_.timeout;
  auto wait_until = [&](auto ready, const std::string& what) {
    for (int i = 1; !ready(); ++i) {
      if (Clock::now() > deadline) fail_attach(where() + ": " + what, true);
      if (i % 500 == 0) {
        for (int q = 0; q < size_; ++q) {
          const std::int32_t pid = slot(q)->pid.load();
          if (q != rank_ && pid > 0 && !process_alive(pid)) {
            fail_attach(where() + ": joining the group failed: " + label(q) + " (pid " +
                            std::to_string(pid) + ") has exited" + note_failure(q),
                        false);
          }
        }
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  };
  wait_until([&] { return header_->magic.load(std::memory_order_acquire) == kMagic; },
             "rank 0 did not initialise the shared memory in time");
  if (header_->size != static_cast<std::uint32_t>(size_) ||
      header_->staging_bytes != options_.staging_bytes ||
      header_->channel_bytes != options_.channel_bytes) {
    throw CommError(where() + ": the ranks disagree on the group's size or shm options");
  }
  slot(rank_)->pid.store(static_cast<std::int32_t>(getpid()));
  header_->attached.fetch_add(1);
  signal();
  wait_until([&] { return header_->attached.load() == static_cast<std::uint32_t>(size_); },
             "not every rank attached to the shared memory in time (" +
                 std::to_string(header_->attached.load()) + " of " + std::to_string(size_) + ")");
  // Every rank removes the name (all but the first find it gone): whichever dies next, the
  // memory goes with the last process that maps it.
  segment_.unlink();
}

void ShmCommunicator::fail_attach(const std::string& message, bool timeout) {
  segment_.unlink();
  if (timeout) throw CommTimeoutError(message);
  throw CommError(message);
}

std::string ShmCommunicator::label(int q) const {
  return q < static_cast<int>(options_.labels.size()) ? options_.labels[q]
                                                      : "rank " + std::to_string(q);
}

std::string ShmCommunicator::note_failure(int q) const {
  const int global =
      q < static_cast<int>(options_.global_ranks.size()) ? options_.global_ranks[q] : q;
  Header* board = board_ ? board_->header_ : header_;
  std::int32_t none = 0;
  if (board->first_failed.compare_exchange_strong(none, global + 1)) return {};
  const int first = none - 1;
  if (first == global) return {};
  const auto it = std::find(options_.global_ranks.begin(), options_.global_ranks.end(), first);
  const std::string who = it != options_.global_ranks.end()
                              ? label(static_cast<int>(it - options_.global_ranks.begin()))
                              : "global rank " + std::to_string(first);
  return " after " + who + " failed first";
}

std::string ShmCommunicator::where() const {
  return "rank " + std::to_string(rank_) + " of group '" + group_name_ + "' (size " +
         std::to_string(size_) + ")";
}

std::uint64_t ShmCommunicator::reserve_steps(std::uint64_t steps) {
  const std::uint64_t first = next_step_ + 1;
  next_step_ += steps;
  return first;
}

void ShmCommunicator::signal() {
  header_->generation.fetch_add(1);
  if (header_->waiters.load() > 0) futex_wake_all(&header_->generation);
}

void ShmCommunicator::count_sent(int peer, std::uint64_t bytes) {
  sent_[peer].fetch_add(bytes, std::memory_order_relaxed);
}

std::vector<std::uint64_t> ShmCommunicator::bytes_sent() const {
  std::vector<std::uint64_t> out;
  for (const auto& s : sent_) out.push_back(s.load());
  return out;
}

void ShmCommunicator::reset_bytes_sent() {
  for (auto& s : sent_) s.store(0);
}

void ShmCommunicator::post_locked(const std::vector<std::shared_ptr<Task>>& tasks,
                                  const char* what) {
  if (!broken_.empty()) {
    throw CommError(where() + ": " + (what ? std::string(what) : tasks.front()->describe()) +
                    " refused: the group failed earlier (" + broken_ + "); create a new group");
  }
  const auto now = Clock::now();
  for (const auto& t : tasks) {
    t->posted = now;
    t->deadline = now + options_.timeout;
    pending_.push_back(t);
  }
  ++posts_;
  progress_locked();
  if (pending_.empty()) return;
  // Something must go on without the caller: an async op left alone, or a synchronous one
  // whose peers have not arrived yet (then the caller's wait takes it over at once).
  if (!progress_.joinable()) {
    start_progress_locked();
  } else if (thread_state_ == ThreadState::kIdle) {
    wake_.notify_one();
  }
}

WorkPtr ShmCommunicator::submit(std::shared_ptr<Task> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    post_locked({task}, nullptr);
  }
  return std::make_shared<ShmWork>(shared_from_this(), std::move(task));
}

WorkPtr ShmCommunicator::all_reduce(Buffer inout, ReduceOp op, StreamHandle /*host memory*/) {
  check_buffer(inout, "all_reduce");
  return submit(make_all_reduce(inout, op));
}

WorkPtr ShmCommunicator::all_gather(Buffer in, Buffer out, StreamHandle /*host memory*/) {
  check_buffer(in, "all_gather");
  check_buffer(out, "all_gather");
  if (const std::string wrong = split_mismatch(out, in, size_, "output", "input"); !wrong.empty()) {
    throw ConfigError("all_gather: " + wrong);
  }
  return submit(make_all_gather(in, out));
}

WorkPtr ShmCommunicator::reduce_scatter(Buffer in, Buffer out, ReduceOp op,
                                        StreamHandle /*host memory*/) {
  check_buffer(in, "reduce_scatter");
  check_buffer(out, "reduce_scatter");
  if (const std::string wrong = split_mismatch(in, out, size_, "input", "output"); !wrong.empty()) {
    throw ConfigError("reduce_scatter: " + wrong);
  }
  return submit(make_reduce_scatter(in, out, op));
}

WorkPtr ShmCommunicator::broadcast(Buffer inout, int root, StreamHandle /*host memory*/) {
  check_buffer(inout, "broadcast");
  if (root < 0 || root >= size_) {
    throw ConfigError("broadcast: root " + std::to_string(root) + " is not a rank of the group");
  }
  return submit(make_broadcast(inout, root));
}

std::vector<WorkPtr> ShmCommunicator::batch_p2p(const std::vector<P2POp>& ops,
                                                StreamHandle /*host memory*/) {
  for (const P2POp& op : ops) {
    check_buffer(op.buffer, op.send ? "send" : "recv");
    if (op.peer < 0 || op.peer >= size_) {
      throw ConfigError(std::string(op.send ? "send" : "recv") + ": peer " +
                        std::to_string(op.peer) + " is not a rank of the group");
    }
  }
  // Each peer's share of the batch, which its messages carry (see PairGroup).
  std::map<int, PairGroup> groups;
  for (const P2POp& op : ops) ++(op.send ? groups[op.peer].sends : groups[op.peer].recvs);
  // All are queued before any progresses, so the batch moves together.
  std::vector<std::shared_ptr<Task>> tasks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [peer, group] : groups) group.index = pair_batches_[peer]++;
    for (const P2POp& op : ops) {
      const PairGroup& group = groups[op.peer];
      tasks.push_back(op.send ? make_send(op.buffer, rank_, op.peer, group)
                              : make_recv(op.buffer, rank_, op.peer, group));
    }
    post_locked(tasks, "point-to-point");
  }
  std::vector<WorkPtr> works;
  works.reserve(tasks.size());
  auto self = shared_from_this();
  for (auto& t : tasks) works.push_back(std::make_shared<ShmWork>(self, t));
  return works;
}

WorkPtr ShmCommunicator::barrier() { return submit(make_barrier()); }

}  // namespace megart::comm::shm
