// The shm transport within one process: both ranks of a group are communicators of this process,
// driven from separate threads, which is enough to check the progress thread's hand-offs and its
// shutdown (run under -fsanitize=thread or address to check them for races and leaks).
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

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
