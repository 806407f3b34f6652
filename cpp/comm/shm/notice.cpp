// The heartbeat of a long wait: a rank blocked on a peer that is alive but makes no progress
// (stopped with SIGSTOP, stuck in a debugger or a system call) has no death to notice, so until
// the timeout ends the job it says, now and then, whom it waits on and in which op. Torch's
// NCCL watchdog and Megatron's straggler detector report hangs in the same spirit.
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "comm/shm/communicator.hpp"

namespace megart::comm::shm {

namespace {

// When this process last printed a notice (steady clock ticks; 0: never), whichever group or
// thread printed it.
std::atomic<std::int64_t> last_notice{0};

}  // namespace

std::chrono::milliseconds wait_notice_interval() {
  // Read once: MEGART_WAIT_NOTICE_S exists so that tests (and impatient users) need not wait a
  // minute; a bad value keeps the default rather than failing a job over a diagnostic.
  static const std::chrono::milliseconds every = [] {
    const char* text = std::getenv("MEGART_WAIT_NOTICE_S");
    double seconds = text != nullptr ? std::atof(text) : 0.0;
    if (!(seconds > 0.0)) seconds = 60.0;
    return std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000.0));
  }();
  return every;
}

bool claim_wait_notice(std::chrono::steady_clock::time_point now) {
  const std::int64_t t = now.time_since_epoch().count();
  const std::int64_t every =
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(wait_notice_interval())
          .count();
  std::int64_t last = last_notice.load();
  if (last != 0 && t - last < every) return false;
  return last_notice.compare_exchange_strong(last, t);
}

std::string ShmCommunicator::wait_notice_locked(const Task& task,
                                                std::chrono::steady_clock::duration waited) const {
  std::string names;
  for (int q : task.waiting_on(*this)) names += (names.empty() ? "" : ", ") + label(q);
  const auto s = [](auto d) {
    return std::to_string(std::chrono::duration_cast<std::chrono::seconds>(d).count());
  };
  return "megart: " + label(rank_) + " is still waiting on " +
         (names.empty() ? std::string("its peers") : names) + " in " + task.describe() +
         " of group '" + group_name_ + "' after " + s(waited) + " s (a stopped or stuck process?" +
         " it gives up after " + s(options_.timeout) + " s: --distributed-timeout-minutes)\n";
}

void write_stderr_line(const std::string& line) {
  // One write(2): the lines of several ranks sharing a terminal never interleave.
  std::size_t done = 0;
  while (done < line.size()) {
    const ssize_t n = ::write(STDERR_FILENO, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // stderr closed: a diagnostic is not worth failing the op over
    done += static_cast<std::size_t>(n);
  }
}

}  // namespace megart::comm::shm
