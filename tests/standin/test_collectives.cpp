// The nccl transport's collectives and point-to-point ops on the stand-in, against float64
// references. Inputs are written by a "kernel" on the caller's stream that runs late (streams
// delay every item at random), and results are read by a kernel on a stream ordered with
// wait_stream, so a missing stream ordering in the transport gives a wrong result.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "typed.hpp"
#include "world.hpp"

namespace megart::standin {
namespace {

using comm::DType;
using comm::ReduceOp;
enum class Kind { AllReduce, AllGather, ReduceScatter, Broadcast };

const DType kAllTypes[] = {DType::Float32, DType::Float16, DType::BFloat16, DType::Float64,
                           DType::Int32,   DType::Int64,   DType::UInt8};

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::AllReduce:
      return "all_reduce";
    case Kind::AllGather:
      return "all_gather";
    case Kind::ReduceScatter:
      return "reduce_scatter";
    case Kind::Broadcast:
      return "broadcast";
  }
  return "?";
}

// Writes `values` into the device buffer from a kernel on `stream`, after a pause, so that an op
// not ordered after the stream reads what was there before.
void produce(cudaStream_t stream, void* dev, const std::vector<double>& values, DType t,
             int pause_us = 500) {
  launch(stream, [dev, values, t, pause_us] {
    std::this_thread::sleep_for(std::chrono::microseconds(pause_us));
    for (std::size_t i = 0; i < values.size(); ++i) put(dev, i, t, values[i]);
  });
}

// Reads the device buffer from a kernel on `stream` into `out`, then waits for the stream.
std::vector<double> consume(cudaStream_t stream, const void* dev, std::size_t n, DType t) {
  std::vector<double> out(n);
  launch(stream, [dev, n, t, &out] {
    for (std::size_t i = 0; i < n; ++i) out[i] = get(dev, i, t);
  });
  cudaStreamSynchronize(stream);
  return out;
}

void check_collective(Kind kind, int size, DType t, ReduceOp op, std::size_t count, unsigned seed,
                      int root = 0) {
  const auto id = new_id();
  const std::size_t n = static_cast<std::size_t>(size);
  const std::size_t in_count = kind == Kind::ReduceScatter ? count * n : count;
  const std::size_t out_count = kind == Kind::AllGather ? count * n : count;
  std::vector<std::vector<double>> in(n);
  for (int q = 0; q < size; ++q) in[q] = inputs(q, in_count, t, seed);
  const std::string what = std::string(kind_name(kind)) + " " + comm::dtype_name(t) + " " +
                           comm::reduce_op_name(op) + " x" + std::to_string(count) + " at " +
                           std::to_string(size) + " ranks";
  run_ranks(size, [&](int r) {
    auto c = create(id, r, size, r);
    cudaStream_t caller = new_stream();
    const std::size_t es = comm::dtype_size(t);
    DeviceBuffer inbuf(std::max<std::size_t>(1, in_count) * es);
    DeviceBuffer outbuf(std::max<std::size_t>(1, out_count) * es);
    void* outp = kind == Kind::AllReduce || kind == Kind::Broadcast ? inbuf.ptr : outbuf.ptr;
    produce(caller, inbuf.ptr, in[r], t);
    const comm::Buffer a{inbuf.ptr, in_count, t};
    const comm::Buffer b{outbuf.ptr, out_count, t};
    comm::WorkPtr w;
    switch (kind) {
      case Kind::AllReduce:
        w = c->all_reduce(a, op, handle(caller));
        break;
      case Kind::AllGather:
        w = c->all_gather(a, b, handle(caller));
        break;
      case Kind::ReduceScatter:
        w = c->reduce_scatter(a, b, op, handle(caller));
        break;
      case Kind::Broadcast:
        w = c->broadcast(a, root, handle(caller));
        break;
    }
    w->wait_stream(handle(caller));
    const auto got = consume(caller, outp, out_count, t);
    for (std::size_t i = 0; i < out_count; ++i) {
      double want = 0, magnitude = 0;
      int terms = 1;
      if (kind == Kind::AllGather) {
        want = in[i / count][i % count];
      } else if (kind == Kind::Broadcast) {
        want = in[root][i];
      } else {
        const std::size_t at = kind == Kind::ReduceScatter ? r * count + i : i;
        want = in[0][at];
        magnitude = std::fabs(want);
        for (int q = 1; q < size; ++q) {
          const double x = in[q][at];
          magnitude += std::fabs(x);
          if (op == ReduceOp::Sum || op == ReduceOp::Avg) want += x;
          if (op == ReduceOp::Max) want = std::max(want, x);
          if (op == ReduceOp::Min) want = std::min(want, x);
        }
        if (op == ReduceOp::Avg) want /= size, magnitude /= size;
        terms = size;
      }
      if (!close(got[i], want, magnitude, t, terms)) {
        test::fail(__FILE__, __LINE__,
                   what + ": rank " + std::to_string(r) + " element " + std::to_string(i) + " is " +
                       std::to_string(got[i]) + ", want " + std::to_string(want));
        break;
      }
    }
    cudaStreamDestroy(caller);
  });
}

TEST(all_reduce_every_dtype_and_op_at_2_and_4_ranks) {
  unsigned seed = 1;
  for (int size : {2, 4}) {
    for (DType t : kAllTypes) {
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min}) {
        if (op == ReduceOp::Avg && !is_float(t)) continue;  // NCCL's avg is for floats
        check_collective(Kind::AllReduce, size, t, op, 1001, ++seed);
      }
    }
  }
}

TEST(all_gather_reduce_scatter_broadcast_every_dtype_at_2_and_4_ranks) {
  unsigned seed = 100;
  for (int size : {2, 4}) {
    for (DType t : kAllTypes) {
      check_collective(Kind::AllGather, size, t, ReduceOp::Sum, 333, ++seed);
      check_collective(Kind::ReduceScatter, size, t, ReduceOp::Sum, 333, ++seed);
      check_collective(Kind::Broadcast, size, t, ReduceOp::Sum, 333, ++seed, size - 1);
    }
    check_collective(Kind::ReduceScatter, size, DType::Float32, ReduceOp::Max, 7, ++seed);
    check_collective(Kind::ReduceScatter, size, DType::BFloat16, ReduceOp::Avg, 7, ++seed);
  }
}

TEST(odd_and_empty_sizes) {
  unsigned seed = 500;
  for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{3}, std::size_t{65537}}) {
    check_collective(Kind::AllReduce, 3, DType::Float32, ReduceOp::Sum, count, ++seed);
    check_collective(Kind::AllGather, 3, DType::BFloat16, ReduceOp::Sum, count, ++seed);
    check_collective(Kind::ReduceScatter, 3, DType::Float16, ReduceOp::Sum, count, ++seed);
  }
}

// The host path: wait() blocks until the op is done, and the buffer is final for the host.
TEST(host_wait_sees_the_result) {
  const auto id = new_id();
  run_ranks(2, [&](int r) {
    auto c = create(id, r, 2, r);
    DeviceBuffer buf(4 * sizeof(float));
    cudaStream_t caller = new_stream();
    produce(caller, buf.ptr, {1.0 + r, 2.0, 3.0, 4.0 * r}, DType::Float32);
    auto w = c->all_reduce({buf.ptr, 4, DType::Float32}, ReduceOp::Sum, handle(caller));
    w->wait();
    CHECK(w->is_completed());
    const float* f = static_cast<const float*>(buf.ptr);
    CHECK(f[0] == 3.0f && f[1] == 4.0f && f[2] == 6.0f && f[3] == 4.0f);
    cudaStreamDestroy(caller);
  });
}

// Four ranks in a world group and two pair groups, ops of all three interleaved.
TEST(subgroups_side_by_side) {
  const auto world_id = new_id();
  const auto pair_ids = std::vector<cuda::NcclUniqueId>{new_id(), new_id()};
  run_ranks(4, [&](int r) {
    auto world = create(world_id, r, 4, r);
    auto pair = create(pair_ids[r / 2], r % 2, 2, r, std::chrono::seconds(20), "pair");
    cudaStream_t caller = new_stream();
    DeviceBuffer a(sizeof(double)), b(sizeof(double));
    for (int step = 0; step < 5; ++step) {
      produce(caller, a.ptr, {static_cast<double>(r + step)}, DType::Float64);
      produce(caller, b.ptr, {static_cast<double>(10 * r)}, DType::Float64);
      auto w1 = world->all_reduce({a.ptr, 1, DType::Float64}, ReduceOp::Sum, handle(caller));
      auto w2 = pair->all_reduce({b.ptr, 1, DType::Float64}, ReduceOp::Max, handle(caller));
      w2->wait_stream(handle(caller));
      w1->wait_stream(handle(caller));
      const auto x = consume(caller, a.ptr, 1, DType::Float64);
      const auto y = consume(caller, b.ptr, 1, DType::Float64);
      CHECK_EQ(x[0], 6.0 + 4 * step);
      CHECK_EQ(y[0], 10.0 * (r / 2 * 2 + 1));
    }
    cudaStreamDestroy(caller);
  });
}

// A ring in both directions in one batch (each rank sends to both neighbours and receives from
// both), with messages above the stand-in's eager limit, so only a batch that really progresses
// together completes; plus a send to self matched in the same batch.
TEST(batched_p2p_rings_and_self) {
  setenv("MEGART_STANDIN_EAGER_BYTES", "4096", 1);
  for (int size : {2, 4}) {
    const auto id = new_id();
    const std::size_t n = 20001;  // 80 KB of float32: above the eager limit
    run_ranks(size, [&](int r) {
      auto c = create(id, r, size, r);
      cudaStream_t caller = new_stream();
      const int next = (r + 1) % size, prev = (r + size - 1) % size;
      DeviceBuffer to_next(n * 4), to_prev(n * 4), from_prev(n * 4), from_next(n * 4);
      DeviceBuffer self_out(8 * 4), self_in(8 * 4);
      auto fill = [&](int tag) {
        std::vector<double> v(n);
        for (std::size_t i = 0; i < n; ++i) v[i] = tag * 100000.0 + i;
        return v;
      };
      produce(caller, to_next.ptr, fill(r * 2), DType::Float32);
      produce(caller, to_prev.ptr, fill(r * 2 + 1), DType::Float32);
      produce(caller, self_out.ptr, std::vector<double>(8, 7.0 + r), DType::Float32);
      std::vector<comm::P2POp> ops = {
          {true, {to_next.ptr, n, DType::Float32}, next},
          {true, {to_prev.ptr, n, DType::Float32}, prev},
          {true, {self_out.ptr, 8, DType::Float32}, r},
          {false, {from_prev.ptr, n, DType::Float32}, prev},
          {false, {from_next.ptr, n, DType::Float32}, next},
          {false, {self_in.ptr, 8, DType::Float32}, r},
      };
      if (size == 2) ops.erase(ops.begin() + 1), ops.erase(ops.begin() + 3);  // next == prev
      auto works = c->batch_p2p(ops, handle(caller));
      for (auto& w : works) w->wait_stream(handle(caller));
      const auto got_prev = consume(caller, from_prev.ptr, n, DType::Float32);
      const auto want_prev = fill(prev * 2);
      CHECK(got_prev == want_prev);
      if (size > 2) {
        const auto got_next = consume(caller, from_next.ptr, n, DType::Float32);
        CHECK(got_next == fill(next * 2 + 1));
      }
      const auto self = consume(caller, self_in.ptr, 8, DType::Float32);
      CHECK(self == std::vector<double>(8, 7.0 + r));
      const auto sent = c->bytes_sent();
      CHECK_EQ(sent[next], n * 4);
      cudaStreamDestroy(caller);
    });
  }
}

// A receive must not write its buffer before the caller's earlier work on it is done: the
// caller's stream overwrites the buffer with a marker late, then the receive lands the message.
TEST(recv_lands_after_the_callers_earlier_writes) {
  const auto id = new_id();
  run_ranks(2, [&](int r) {
    auto c = create(id, r, 2, r);
    cudaStream_t caller = new_stream();
    DeviceBuffer buf(64 * 4);
    for (int round = 0; round < 4; ++round) {
      std::vector<double> mine(64, r * 10.0 + round);
      std::vector<double> marker(64, -1.0);
      DeviceBuffer out(64 * 4);
      produce(caller, out.ptr, mine, DType::Float32);
      produce(caller, buf.ptr, marker, DType::Float32);
      auto works = c->batch_p2p({{true, {out.ptr, 64, DType::Float32}, 1 - r},
                                 {false, {buf.ptr, 64, DType::Float32}, 1 - r}},
                                handle(caller));
      for (auto& w : works) w->wait_stream(handle(caller));
      const auto got = consume(caller, buf.ptr, 64, DType::Float32);
      CHECK(got == std::vector<double>(64, (1 - r) * 10.0 + round));
    }
    cudaStreamDestroy(caller);
  });
}

// Batches of only sends and only receives (a pipeline stage's usual pattern): NCCL joins the
// streams of a batch, so with both kinds in one batch either stream's wait orders both; alone,
// each stream must wait on the caller's work itself. The side under test is slow by far more
// than the streams' random delays (even rounds the sender's write, odd rounds the receiver's
// marker), so a missing wait is a wrong result every time, not when the delays happen to line up.
TEST(send_only_and_recv_only_batches_follow_the_callers_stream) {
  const auto id = new_id();
  constexpr int kSlowUs = 50000;
  run_ranks(2, [&](int r) {
    auto c = create(id, r, 2, r);
    cudaStream_t caller = new_stream();
    for (int round = 0; round < 4; ++round) {
      const bool sender_slow = round % 2 == 0;
      DeviceBuffer buf(256 * 4);
      if (r == 0) {
        produce(caller, buf.ptr, std::vector<double>(256, 3.0 + round), DType::Float32,
                sender_slow ? kSlowUs : 0);
        auto works = c->batch_p2p({{true, {buf.ptr, 256, DType::Float32}, 1}}, handle(caller));
        works[0]->wait_stream(handle(caller));
      } else {
        produce(caller, buf.ptr, std::vector<double>(256, -1.0), DType::Float32,
                sender_slow ? 0 : kSlowUs);
        auto works = c->batch_p2p({{false, {buf.ptr, 256, DType::Float32}, 0}}, handle(caller));
        works[0]->wait_stream(handle(caller));
        const auto got = consume(caller, buf.ptr, 256, DType::Float32);
        CHECK(got == std::vector<double>(256, 3.0 + round));
      }
      cudaStreamSynchronize(caller);
    }
    cudaStreamDestroy(caller);
  });
}

// Several ops in flight, waited in reverse order and by polling; results all correct.
TEST(async_ops_waited_in_any_order) {
  const auto id = new_id();
  run_ranks(4, [&](int r) {
    auto c = create(id, r, 4, r);
    cudaStream_t caller = new_stream();
    std::vector<std::unique_ptr<DeviceBuffer>> bufs;
    std::vector<comm::WorkPtr> works;
    for (int k = 0; k < 6; ++k) {
      bufs.push_back(std::make_unique<DeviceBuffer>(16 * 4));
      produce(caller, bufs.back()->ptr, std::vector<double>(16, r + k), DType::Float32);
      works.push_back(
          c->all_reduce({bufs.back()->ptr, 16, DType::Float32}, ReduceOp::Sum, handle(caller)));
    }
    works[5]->wait();
    for (int k = 0; k < 5; k += 2) {
      while (!works[k]->is_completed()) std::this_thread::yield();
    }
    for (int k = 4; k >= 0; --k) works[k]->wait();
    for (int k = 0; k < 6; ++k) {
      const float* f = static_cast<const float*>(bufs[k]->ptr);
      CHECK_EQ(f[15], static_cast<float>(6 + 4 * k));
    }
    cudaStreamSynchronize(caller);
    cudaStreamDestroy(caller);
  });
}

// wait_stream orders another stream (a consumer that is not the caller's) after the op.
TEST(wait_stream_orders_a_consumer_stream) {
  const auto id = new_id();
  run_ranks(2, [&](int r) {
    auto c = create(id, r, 2, r);
    cudaStream_t caller = new_stream(), consumer = new_stream();
    for (int round = 0; round < 8; ++round) {
      DeviceBuffer buf(1000 * 4);
      produce(caller, buf.ptr, std::vector<double>(1000, r + round), DType::Float32);
      auto w = c->all_reduce({buf.ptr, 1000, DType::Float32}, ReduceOp::Sum, handle(caller));
      w->wait_stream(handle(consumer));
      const auto got = consume(consumer, buf.ptr, 1000, DType::Float32);
      CHECK(got == std::vector<double>(1000, 1 + 2 * round));
      cudaStreamSynchronize(caller);
    }
    cudaStreamDestroy(caller);
    cudaStreamDestroy(consumer);
  });
}

}  // namespace
}  // namespace megart::standin
