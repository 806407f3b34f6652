// The shm transport within one process: both ranks of a group are communicators of this process,
// driven from separate threads, which is enough to check the progress thread's hand-offs and its
// shutdown (run under -fsanitize=thread or address to check them for races and leaks).
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/nccl_library.hpp"
#include "comm/shm/communicator.hpp"
#include "common/error.hpp"
#include "test.hpp"

using namespace megart::comm;
using megart::comm::shm::ShmCommunicator;

namespace {

using Pair = std::pair<std::shared_ptr<ShmCommunicator>, std::shared_ptr<ShmCommunicator>>;

// Both ranks of a fresh 2-rank group (creating one is collective, so rank 1 joins from a thread).
Pair make_pair_group(std::chrono::milliseconds timeout) {
  static std::atomic<int> made{0};
  const std::string name =
      "/megart-unit-" + std::to_string(getpid()) + "-" + std::to_string(made++);
  shm::Options options;
  options.timeout = timeout;
  std::shared_ptr<ShmCommunicator> one;
  std::thread joiner([&] { one = ShmCommunicator::create(name, "unit", 1, 2, options); });
  auto zero = ShmCommunicator::create(name, "unit", 0, 2, options);
  joiner.join();
  return {zero, one};
}

Buffer floats(std::vector<float>& v) { return Buffer{v.data(), v.size(), DType::Float32}; }

}  // namespace

TEST(shm_async_all_reduce_moves_without_its_poster) {
  auto [zero, one] = make_pair_group(std::chrono::seconds(20));
  // 4 MiB: twice what one staging step carries, so posting alone cannot finish it.
  std::vector<float> a(1 << 20, 1.0f), b(1 << 20, 2.0f);
  auto posted = zero->all_reduce(floats(a), ReduceOp::Sum, 0);
  // Rank 1 waits in its own thread; rank 0's threads never call into the group again until
  // rank 1 is done, so only rank 0's progress thread can carry rank 0's part.
  std::string error;
  std::thread peer([&, one = one] {
    try {
      one->all_reduce(floats(b), ReduceOp::Sum, 0)->wait();
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  peer.join();
  CHECK_EQ(error, std::string());
  CHECK(posted->is_completed());
  posted->wait();
  CHECK_EQ(a.front(), 3.0f);
  CHECK_EQ(a.back(), 3.0f);
  CHECK_EQ(b[12345], 3.0f);
}

TEST(shm_timeout_found_by_the_progress_thread_reaches_wait) {
  auto [zero, one] = make_pair_group(std::chrono::milliseconds(300));
  std::vector<float> a(10, 1.0f);
  auto posted = zero->all_reduce(floats(a), ReduceOp::Sum, 0);  // rank 1 never joins
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!posted->is_completed() && std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  CHECK(posted->is_completed());
  CHECK_THROWS(megart::CommTimeoutError, posted->wait(),
               "timed out after 300 ms waiting for rank 1");
}

TEST(shm_groups_dropped_with_ops_in_flight_stop_their_threads) {
  for (int i = 0; i < 20; ++i) {
    auto [zero, one] = make_pair_group(std::chrono::seconds(20));
    std::vector<float> a(1 << 20, 1.0f), b(16, 1.0f);
    auto big = zero->all_reduce(floats(a), ReduceOp::Sum, 0);              // never joined by rank 1
    auto recv = one->batch_p2p({P2POp{false, floats(b), 0}}, 0);           // never sent
    if (i % 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));  // threads asleep
    big.reset();
    recv.clear();
    zero.reset();  // joins rank 0's thread before unmapping
    one.reset();
  }
}

// ---- NCCL's non-blocking state rule (wait_nccl_state), with a scripted ncclCommGetAsyncError ----

namespace {

// Answers the polls in turn with (the poll's own result, the state it writes); counts them.
struct ScriptedPoll {
  std::vector<std::pair<int, int>> answers;
  int calls = 0;
  int operator()(int* state) {
    const auto& [result, written] = answers.at(static_cast<std::size_t>(calls++));
    *state = written;
    return result;
  }
};

std::chrono::steady_clock::time_point in_seconds(int s) {
  return std::chrono::steady_clock::now() + std::chrono::seconds(s);
}

}  // namespace

TEST(nccl_state_other_than_in_progress_is_returned_without_polling) {
  ScriptedPoll poll;
  CHECK_EQ(wait_nccl_state(kNcclSuccess, std::ref(poll), in_seconds(5)), kNcclSuccess);
  CHECK_EQ(wait_nccl_state(5, std::ref(poll), in_seconds(5)), 5);  // ncclInvalidUsage
  CHECK_EQ(poll.calls, 0);
}

TEST(nccl_in_progress_is_polled_until_it_settles) {
  ScriptedPoll ok{{{kNcclSuccess, kNcclInProgress},
                   {kNcclSuccess, kNcclInProgress},
                   {kNcclSuccess, kNcclSuccess}}};
  CHECK_EQ(wait_nccl_state(kNcclInProgress, std::ref(ok), in_seconds(5)), kNcclSuccess);
  CHECK_EQ(ok.calls, 3);
  ScriptedPoll remote{{{kNcclSuccess, kNcclInProgress}, {kNcclSuccess, 6}}};  // ncclRemoteError
  CHECK_EQ(wait_nccl_state(kNcclInProgress, std::ref(remote), in_seconds(5)), 6);
  ScriptedPoll broken{{{4, kNcclSuccess}}};  // the poll itself fails: its result wins
  CHECK_EQ(wait_nccl_state(kNcclInProgress, std::ref(broken), in_seconds(5)), 4);
}

TEST(nccl_in_progress_past_the_deadline_stays_in_progress) {
  int calls = 0;
  auto forever = [&](int* state) {
    ++calls;
    *state = kNcclInProgress;
    return kNcclSuccess;
  };
  const auto start = std::chrono::steady_clock::now();
  const int state =
      wait_nccl_state(kNcclInProgress, forever, start + std::chrono::milliseconds(30));
  const auto took = std::chrono::steady_clock::now() - start;
  CHECK_EQ(state, kNcclInProgress);
  CHECK(took >= std::chrono::milliseconds(30));
  CHECK(took < std::chrono::seconds(5));
  CHECK(calls > 1 && calls < 3000);  // sleeps between polls rather than spinning
}
