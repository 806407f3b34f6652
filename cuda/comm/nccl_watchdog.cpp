#include "comm/nccl_watchdog.hpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/nccl_communicator.hpp"

namespace megart::cuda {

namespace {

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoi(v) : fallback;
}

class Watchdog {
 public:
  static Watchdog& instance() {
    // Never destroyed: its thread runs for the life of the process (a detached thread must not
    // see its state destroyed at exit).
    static Watchdog* dog = new Watchdog();
    return *dog;
  }

  void add(const std::shared_ptr<NcclCommunicator>& comm) {
    std::lock_guard<std::mutex> lock(mu_);
    watched_.push_back(comm);
    if (!started_) {
      started_ = true;
      std::thread([this] { run(); }).detach();
    }
  }

 private:
  void run() {
    const auto period = std::chrono::milliseconds(env_int("MEGART_NCCL_WATCHDOG_INTERVAL_MS", 100));
    for (;;) {
      std::this_thread::sleep_for(period);
      std::vector<std::shared_ptr<NcclCommunicator>> live;
      {
        std::lock_guard<std::mutex> lock(mu_);
        std::vector<std::weak_ptr<NcclCommunicator>> kept;
        for (auto& w : watched_) {
          if (auto c = w.lock()) {
            live.push_back(c);
            kept.push_back(w);
          }
        }
        watched_.swap(kept);
      }
      for (auto& c : live) {
        const std::string failure = c->check_health();
        if (failure.empty()) continue;
        // The communicator is aborted already (check_health did it), so no kernel of it keeps
        // spinning; Python cannot unwind from this thread, so the process ends here, loudly.
        std::fprintf(stderr,
                     "megart: %s. The nccl watchdog ended this process (exit status %d); set "
                     "MEGART_NCCL_WATCHDOG=0 to raise the error at the next wait instead.\n",
                     failure.c_str(), kWatchdogExitStatus);
        std::fflush(stderr);
        std::_Exit(kWatchdogExitStatus);
      }
    }
  }

  std::mutex mu_;
  std::vector<std::weak_ptr<NcclCommunicator>> watched_;
  bool started_ = false;
};

}  // namespace

void watch(const std::shared_ptr<NcclCommunicator>& comm) {
  const char* env = std::getenv("MEGART_NCCL_WATCHDOG");
  if (env != nullptr && std::string(env) == "0") return;
  Watchdog::instance().add(comm);
}

}  // namespace megart::cuda
