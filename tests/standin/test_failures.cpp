// Failures on the stand-in: dead and stuck peers, aborts, an init that never completes, a
// communicator dropped with work in flight, and the costs the transport must not pay per op.
// Cases named *_ends_the_process run with the watchdog on and pass only if the watchdog ends the
// process first (tests/test_nccl_standin.py checks its exit status and message); the others run
// with MEGART_NCCL_WATCHDOG=0, so that errors surface where the caller waits.
#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "common/error.hpp"
#include "world.hpp"

namespace megart::standin {
namespace {

using comm::DType;
using comm::ReduceOp;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Rank 0 posts an all-reduce that rank 1 never joins: rank 1 either dies (its "process" exits)
// or is stuck (alive, never posting). Returns rank 0's Work; rank 1's thread has finished.
struct Pair {
  Comm c0, c1;
  cudaStream_t stream = nullptr;
};

Pair make_pair(milliseconds timeout) {
  const auto id = new_id();
  Pair p;
  std::thread t1([&] { p.c1 = create(id, 1, 2, 1, timeout); });
  p.c0 = create(id, 0, 2, 0, timeout);
  t1.join();
  cudaSetDevice(0);
  p.stream = new_stream();
  return p;
}

// Nobody waits on the failed op (as a training loop that next syncs through loss.item()): the
// watchdog must end the process within seconds; returning from here is the failure (after
// aborting `c`, so that the stuck kernel does not hang the test's clean-up).
void expect_the_watchdog_to_end_this_process(const Comm& c) {
  std::this_thread::sleep_for(std::chrono::seconds(15));
  test::fail(__FILE__, __LINE__, "the watchdog did not end the process");
  c->abort();
}

TEST(dead_peer_raises_at_wait) {
  auto p = make_pair(milliseconds(20000));
  DeviceBuffer buf(64);
  auto w = p.c0->all_reduce({buf.ptr, 16, DType::Float32}, ReduceOp::Sum, handle(p.stream));
  kill_device(1);  // rank 1's process exits
  const auto t0 = Clock::now();
  CHECK_THROWS(CommError, w->wait(), "remote process exited");
  CHECK(seconds_since(t0) < 5);  // seen through NCCL's async error, long before the timeout
  CHECK_THROWS(CommError, p.c0->all_reduce({buf.ptr, 1, DType::Float32}, ReduceOp::Sum, 0),
               "the group failed earlier");
}

TEST(dead_peer_ends_the_process) {
  auto p = make_pair(milliseconds(20000));
  DeviceBuffer buf(64);
  auto w = p.c0->all_reduce({buf.ptr, 16, DType::Float32}, ReduceOp::Sum, handle(p.stream));
  kill_device(1);
  expect_the_watchdog_to_end_this_process(p.c0);
}

TEST(stuck_peer_times_out_at_wait) {
  auto p = make_pair(milliseconds(1000));
  DeviceBuffer buf(64);
  auto w = p.c0->all_reduce({buf.ptr, 16, DType::Float32}, ReduceOp::Sum, handle(p.stream));
  const auto t0 = Clock::now();
  CHECK_THROWS(CommTimeoutError, w->wait(), "timed out after 1000 ms waiting for ranks 0..1");
  CHECK(seconds_since(t0) < 3);
  // Aborting ended the kernel: the stream drains, as ncclCommAbort promises.
  CHECK_EQ(cudaStreamSynchronize(p.stream), cudaSuccess);
}

TEST(stuck_peer_ends_the_process) {
  auto p = make_pair(milliseconds(1000));
  DeviceBuffer buf(64);
  auto w = p.c0->all_reduce({buf.ptr, 16, DType::Float32}, ReduceOp::Sum, handle(p.stream));
  expect_the_watchdog_to_end_this_process(p.c0);
}

TEST(abort_fails_ops_in_flight) {
  auto p = make_pair(milliseconds(20000));
  DeviceBuffer buf(64);
  auto w = p.c0->all_reduce({buf.ptr, 16, DType::Float32}, ReduceOp::Sum, handle(p.stream));
  std::thread aborter([&] {
    std::this_thread::sleep_for(milliseconds(100));
    p.c0->abort();
  });
  CHECK_THROWS(CommError, w->wait(), "aborted by rank 0");
  aborter.join();
  CHECK_EQ(cudaStreamSynchronize(p.stream), cudaSuccess);
}

TEST(init_that_never_completes_times_out) {
  const auto id = new_id();
  const auto t0 = Clock::now();
  CHECK_THROWS(CommTimeoutError, create(id, 0, 2, 0, milliseconds(800)),
               "not every rank of the group joined");
  CHECK(seconds_since(t0) < 3);
}

TEST(destroy_with_work_in_flight_does_not_hang) {
  auto p = make_pair(milliseconds(20000));
  {
    DeviceBuffer buf(64);
    p.c0->all_reduce({buf.ptr, 16, DType::Float32}, ReduceOp::Sum, handle(p.stream));
    const auto t0 = Clock::now();
    p.c0.reset();                  // the Work was dropped too: the communicator's last owner goes
    CHECK(seconds_since(t0) < 2);  // aborted, not finalized: no wait for the peer
    CHECK_EQ(cudaStreamSynchronize(p.stream), cudaSuccess);  // the kernel ended
  }
}

TEST(ops_run_on_a_blocking_communicator) {
  const auto id = new_id();
  run_ranks(2, [&](int r) {
    auto c = create(id, r, 2, r);
    CHECK(c->blocking_ops());
    DeviceBuffer buf(64);
    static std::atomic<unsigned long long> before{0};
    if (r == 0) before = async_calls();
    for (int k = 0; k < 50; ++k) {
      c->all_reduce({buf.ptr, 16, DType::Float32}, ReduceOp::Sum, 0)->wait();
    }
    // No op went through NCCL's per-call thread of a non-blocking communicator.
    if (r == 0) CHECK_EQ(async_calls(), before.load());
  });
}

TEST(completion_events_are_reused) {
  const auto id = new_id();
  const unsigned long long before = megartStandinLiveEvents();
  run_ranks(2, [&](int r) {
    auto c = create(id, r, 2, r);
    DeviceBuffer buf(64);
    for (int k = 0; k < 300; ++k) {
      c->all_reduce({buf.ptr, 16, DType::Float32}, ReduceOp::Sum, 0)->wait();
    }
  });
  // Per communicator: one caller event plus the few pooled completion events in use at once,
  // not one per op (each op creating and destroying its own shows as churn, not growth, so the
  // stand-in counts creations too).
  CHECK(megartStandinLiveEvents() - before <= 8);
  CHECK(megartStandinEventsCreated() < 40);
}

// Rank 0 posts [send, recv] with rank 1 as one batch, rank 1 only [recv]: NCCL leaves that
// undefined (on an H200 it failed a pipeline with "Message truncated"); the stand-in refuses
// it, and rank 1's wait raises naming both groupings. Rank 0's receive never comes: it times out.
TEST(p2p_grouped_differently_raises_at_wait) {
  const auto id = new_id();
  run_ranks(2, [&](int r) {
    auto c = create(id, r, 2, r, milliseconds(3000));
    cudaStream_t stream = new_stream();
    DeviceBuffer out(64), in(64);
    if (r == 0) {
      auto works = c->batch_p2p(
          {{true, {out.ptr, 4, DType::Float32}, 1}, {false, {in.ptr, 4, DType::Float32}, 1}},
          handle(stream));
      CHECK_THROWS(CommError, works[1]->wait(), "rank 0");
    } else {
      auto works = c->batch_p2p({{false, {in.ptr, 4, DType::Float32}, 0}}, handle(stream));
      CHECK_THROWS(CommError, works[0]->wait(), "grouped its messages to rank 1 differently");
    }
  });
}

}  // namespace
}  // namespace megart::standin
