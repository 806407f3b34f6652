// How the shm transport's ops move: the progress engine (progress_locked), waits, health checks
// (abort, dead peers, deadlines) and the progress thread.
//
// Who advances pending tasks, in order of preference:
//  - the thread that posts an op, once (a message that fits its ring is delivered at once);
//  - a thread inside wait(): it spins or sleeps on the segment's futex and advances every pending
//    task, so a synchronous op never waits on a hand-off to another thread;
//  - otherwise the progress thread, once the oldest pending task has gone unattended for a short
//    grace (a synchronous op is waited on within microseconds of its post, so it never wakes the
//    thread). It sleeps on the segment's futex while it has work that cannot move, and on a
//    condition variable while it has none. Posts notify it only when it sleeps without a timer
//    (nothing posted for a while): while ops keep coming, waited on or not, it looks again every
//    kAlert instead, so a stream of synchronous ops costs at most one wake-up per kAlert.
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "comm/shm/communicator.hpp"
#include "common/error.hpp"

namespace megart::comm::shm {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::microseconds;
using std::chrono::milliseconds;

// How long a just-posted op is left to its poster before the thread takes it over.
constexpr microseconds kGrace{200};
// While ops are being posted, the thread looks this often for ones left unattended.
constexpr milliseconds kAlert{1};
// Dead peers are looked for this often (reading /proc), not on every wake.
constexpr milliseconds kPeerCheck{100};
// The longest futex sleep: a peer's death wakes nobody, so sleepers look again this often.
constexpr milliseconds kLongestNap{100};

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Counts this thread among the group's futex sleepers for as long as it lives, so that every
// signal() wakes it.
class Sleeper {
 public:
  explicit Sleeper(Header* h) : h_(h) { h_->waiters.fetch_add(1); }
  ~Sleeper() { h_->waiters.fetch_sub(1); }
  Sleeper(const Sleeper&) = delete;
  Sleeper& operator=(const Sleeper&) = delete;

 private:
  Header* h_;
};

std::exception_ptr comm_error(const std::string& message, bool timeout) {
  return timeout ? std::make_exception_ptr(CommTimeoutError(message))
                 : std::make_exception_ptr(CommError(message));
}

}  // namespace

void ShmCommunicator::progress_locked() {
  if (pending_.empty()) return;
  if (header_->aborted_by.load() >= 0 && broken_.empty()) {
    broken_ = "the group was aborted by rank " + std::to_string(header_->aborted_by.load());
  }
  if (!broken_.empty()) {
    for (auto& t : pending_) {
      t->error =
          comm_error(where() + ": " + t->describe() + " failed: " + broken_, broken_by_timeout_);
      t->done = true;
    }
    pending_.clear();
    return;
  }
  try {
    while (true) {
      std::uint64_t moved_before = 0, moved_after = 0;
      bool collective_blocked = false;
      std::set<std::pair<int, int>> busy_lanes;
      for (auto it = pending_.begin(); it != pending_.end();) {
        Task& t = **it;
        const bool skip = t.collective() ? collective_blocked : busy_lanes.count(t.lane());
        if (skip) {
          ++it;
          continue;
        }
        moved_before += t.moved;
        const bool finished = t.step(*this);
        moved_after += t.moved;
        if (finished) {
          t.done = true;
          it = pending_.erase(it);
          signal();  // a thread of this process may be asleep waiting for it
          continue;
        }
        if (t.collective()) {
          collective_blocked = true;
        } else {
          busy_lanes.insert(t.lane());
        }
        ++it;
      }
      if (moved_after == moved_before) break;
    }
  } catch (const std::exception& e) {
    broken_ = e.what();
    progress_locked();  // fails every pending task with the error
    signal();
  }
}

bool ShmCommunicator::poll(const std::shared_ptr<Task>& task) {
  std::lock_guard<std::mutex> lock(mu_);
  progress_locked();
  return task->done;
}

std::string ShmCommunicator::health_locked(const Task& task, bool check_peers,
                                           bool* timeout) const {
  *timeout = false;
  const int aborter = header_->aborted_by.load();
  if (aborter >= 0) {
    return task.describe() + " failed: the group was aborted by rank " + std::to_string(aborter);
  }
  const bool late = Clock::now() > task.deadline;
  if (!check_peers && !late) return {};
  const std::vector<int> peers = task.waiting_on(*this);
  if (check_peers) {
    for (int q : peers) {
      const pid_t pid = slot(q)->pid.load();
      if (q != rank_ && pid > 0 && !process_alive(pid)) {
        return task.describe() + " failed: " + label(q) + " (pid " + std::to_string(pid) +
               ") has exited" + note_failure(q);
      }
    }
  }
  if (!late) return {};
  std::string names;
  for (int q : peers) names += (names.empty() ? "" : ", ") + label(q);
  *timeout = true;
  // The one peer that never came is recorded as the job's first failure, so that survivors
  // whose waits end because this rank now exits name it, not this rank.
  const std::string first = peers.size() == 1 ? note_failure(peers[0]) : std::string();
  return task.describe() + " timed out after " + std::to_string(options_.timeout.count()) +
         " ms waiting for " + (names.empty() ? std::string("its peers") : names) + first +
         " (a stopped or stuck process; --distributed-timeout-minutes sets this limit)";
}

void ShmCommunicator::fail_locked(const std::string& message, bool timeout, Task* culprit) {
  if (broken_.empty()) {
    broken_ = message;
    broken_by_timeout_ = timeout;
  }
  if (culprit != nullptr && !culprit->done) {
    const auto it =
        std::find_if(pending_.begin(), pending_.end(),
                     [&](const std::shared_ptr<Task>& t) { return t.get() == culprit; });
    if (it != pending_.end()) pending_.erase(it);
    culprit->error = comm_error(where() + ": " + message, timeout);
    culprit->done = true;
  }
  progress_locked();  // fails what else is pending
  signal();           // peers and local sleepers look at the group again
}

void ShmCommunicator::wait(const std::shared_ptr<Task>& task) {
  if (!task->done) {
    waiting_.fetch_add(1);
    struct Leave {
      ShmCommunicator* c;
      ~Leave() { c->leave_wait(); }
    } leave{this};
    // When every rank has a core, poll before sleeping: a futex wake-up takes tens of
    // microseconds on a VM, and two ranks whose spins are shorter than that fall into a rhythm
    // where every op pays one. Every 16th poll yields the core, from the first one on: "every
    // rank has a core" does not mean the scheduler gave each its own, and a peer that shares
    // this core (as two ranks often do for a while after both slept) can only make the
    // progress we poll for once we step aside. Yielding only after a 20 us spin made each
    // ring exchange between two such ranks cost two spins, ~45 us instead of ~20 us, which
    // was the slow start of the p2p benchmark. Past 1 ms the wait sleeps.
    if (spin_) {
      const auto start = Clock::now();
      for (int i = 1; !task->done; ++i) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          progress_locked();
        }
        if (task->done) break;
        if (i % 16 == 0) {
          if (Clock::now() - start > milliseconds(1)) break;
          sched_yield();  // returns at once when nothing else wants this core
        }
        cpu_relax();
      }
    }
    auto last_check = Clock::now();
    auto next_notice = task->posted + wait_notice_interval();
    while (!task->done) {
      Sleeper sleeper(header_);
      const std::uint32_t generation = header_->generation.load();
      Clock::duration nap;
      std::string notice;
      {
        std::lock_guard<std::mutex> lock(mu_);
        progress_locked();
        if (task->done) break;
        const auto now = Clock::now();
        const bool check_peers = now - last_check > kPeerCheck;
        if (check_peers) last_check = now;
        bool timeout = false;
        const std::string problem = health_locked(*task, check_peers, &timeout);
        if (!problem.empty()) {
          fail_locked(problem, timeout, task.get());
          break;
        }
        if (now >= next_notice) {  // blocked a while: say on whom (printed outside the lock)
          next_notice = now + wait_notice_interval();
          if (claim_wait_notice(now)) notice = wait_notice_locked(*task, now - task->posted);
        }
        nap = std::min<Clock::duration>(task->deadline - now, kLongestNap);
      }
      if (!notice.empty()) write_stderr_line(notice);
      futex_wait(&header_->generation, generation, nap);
    }
  }
  if (task->error) std::rethrow_exception(task->error);
}

void ShmCommunicator::leave_wait() {
  if (waiting_.fetch_sub(1) != 1) return;
  std::lock_guard<std::mutex> lock(mu_);
  // The thread takes over what the waiter left (an async op nobody waits on) now rather than
  // at its next look; with nothing left, only a thread asleep without a timer needs waking.
  const bool left_work = !pending_.empty() && thread_state_ == ThreadState::kAlert;
  if (thread_state_ == ThreadState::kAside || left_work) wake_.notify_one();
}

void ShmCommunicator::abort() {
  int none = -1;
  header_->aborted_by.compare_exchange_strong(none, rank_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_.empty()) broken_ = "aborted by rank " + std::to_string(rank_);
    progress_locked();
  }
  signal();
}

void ShmCommunicator::start_progress_locked() {
  if (no_thread_) return;
  try {
    progress_ = std::thread([this] { progress_loop(); });
  } catch (const std::system_error&) {
    // No thread to be had (a process limit): ops still progress whenever this rank waits.
    no_thread_ = true;
  }
}

void ShmCommunicator::sleep_locked(std::unique_lock<std::mutex>& lock, ThreadState state,
                                   std::optional<std::chrono::nanoseconds> timeout) {
  thread_state_ = state;
  if (timeout) {
    wake_.wait_for(lock, *timeout);
  } else {
    wake_.wait(lock);
  }
  thread_state_ = ThreadState::kBusy;
}

void ShmCommunicator::progress_loop() {
  pthread_setname_np(pthread_self(), "megart-shm");
  std::unique_lock<std::mutex> lock(mu_);
  std::uint64_t seen_posts = posts_;
  auto last_peer_check = Clock::now();
  try {
    while (!stop_) {
      if (pending_.empty()) {
        if (posts_ != seen_posts) {  // ops are being posted: look again soon, unasked
          seen_posts = posts_;
          sleep_locked(lock, ThreadState::kAlert, kAlert);
        } else {  // quiet: sleep until a post notifies
          sleep_locked(lock, ThreadState::kIdle, std::nullopt);
        }
        continue;
      }
      if (waiting_.load() > 0) {  // the waiter advances everything
        if (posts_ != seen_posts) {
          // Ops are being posted and waited on: look again soon, so that no post and no
          // leave_wait() has to wake the thread. (Sleeping until the waiter leaves would take
          // a wake-up per op once each wait outlasts the next post's arrival.)
          seen_posts = posts_;
          sleep_locked(lock, ThreadState::kAlert, kAlert);
        } else {  // one long wait: asleep until the waiter leaves; leave_wait() notifies
          sleep_locked(lock, ThreadState::kAside, std::nullopt);
        }
        continue;
      }
      const auto now = Clock::now();
      const auto age = now - pending_.front()->posted;
      if (age < kGrace) {  // maybe a synchronous op whose wait() is just coming
        sleep_locked(lock, ThreadState::kAlert, kGrace - age);
        continue;
      }
      const std::uint32_t generation = header_->generation.load();
      progress_locked();
      if (pending_.empty() || waiting_.load() > 0) continue;
      const bool check_peers = now - last_peer_check > kPeerCheck;
      if (check_peers) last_peer_check = now;
      Clock::duration nap = kLongestNap;
      for (const auto& t : pending_) {
        bool timeout = false;
        const std::string problem = health_locked(*t, check_peers, &timeout);
        if (!problem.empty()) {
          fail_locked(problem, timeout, t.get());  // the error waits in the task for wait()
          break;
        }
        nap = std::min<Clock::duration>(nap, t->deadline - now);
      }
      if (pending_.empty()) continue;
      lock.unlock();
      {
        Sleeper sleeper(header_);
        futex_wait(&header_->generation, generation, nap);
      }
      lock.lock();
    }
  } catch (const std::exception& e) {
    // Only allocation can fail here. Fail what is pending rather than leave it unattended; the
    // thread ends, and later ops progress when waited on.
    if (!lock.owns_lock()) lock.lock();
    fail_locked(std::string("the progress thread failed: ") + e.what(), false, nullptr);
    no_thread_ = true;
  }
}

ShmCommunicator::~ShmCommunicator() {
  // The thread reads the segment: it must end before the members (the mapping) are destroyed.
  if (!progress_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  signal();  // ends a futex sleep (a spurious wake-up for the peers, which look and sleep again)
  progress_.join();
}

}  // namespace megart::comm::shm
