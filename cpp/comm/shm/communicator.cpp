#include "comm/shm/communicator.hpp"

#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <fstream>
#include <set>
#include <thread>

#include "comm/shm/tasks.hpp"
#include "common/error.hpp"

namespace megart::comm::shm {

namespace {

using Clock = std::chrono::steady_clock;

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

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

// Whether a process still runs. A zombie (exited, not yet reaped by its parent, as a crashed
// rank is until its launcher collects it) counts as gone.
bool process_alive(pid_t pid) {
  if (kill(pid, 0) != 0) return errno != ESRCH;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return true;
  const auto paren = line.rfind(')');
  if (paren == std::string::npos || paren + 2 >= line.size()) return true;
  const char state = line[paren + 2];
  return state != 'Z' && state != 'X';
}

// Counts this process among the sleepers for as long as it lives.
class Sleeper {
 public:
  explicit Sleeper(Header* h) : h_(h) { h_->waiters.fetch_add(1); }
  ~Sleeper() { h_->waiters.fetch_sub(1); }
  Sleeper(const Sleeper&) = delete;
  Sleeper& operator=(const Sleeper&) = delete;

 private:
  Header* h_;
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
                                                         int size, const Options& options) {
  if (size < 1 || rank < 0 || rank >= size) {
    throw ConfigError("rank " + std::to_string(rank) + " is not in a group of size " +
                      std::to_string(size));
  }
  if (options.staging_bytes < 4096 || options.channel_bytes < 4096) {
    throw ConfigError("shm staging and channel sizes must be at least 4096 bytes");
  }
  const Layout layout(size, options.staging_bytes, options.channel_bytes);
  Segment segment = rank == 0 ? Segment::create(shm_name, layout.total_bytes())
                              : Segment::open(shm_name, layout.total_bytes(), options.timeout);
  std::shared_ptr<ShmCommunicator> c(
      new ShmCommunicator(std::move(segment), layout, group_name, rank, size, options));
  c->attach();
  return c;
}

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
      sent_(size) {}

void ShmCommunicator::attach() {
  if (rank_ == 0) {
    header_->size = static_cast<std::uint32_t>(size_);
    header_->staging_bytes = options_.staging_bytes;
    header_->channel_bytes = options_.channel_bytes;
    header_->aborted_by.store(-1);
    header_->magic.store(kMagic, std::memory_order_release);
  }
  const auto deadline = Clock::now() + options_.timeout;
  auto wait_until = [&](auto ready, const std::string& what) {
    while (!ready()) {
      if (Clock::now() > deadline) fail(what, true);
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  };
  wait_until([&] { return header_->magic.load(std::memory_order_acquire) == kMagic; },
             "rank 0 did not initialise the shared memory in time");
  if (header_->size != static_cast<std::uint32_t>(size_) ||
      header_->staging_bytes != options_.staging_bytes ||
      header_->channel_bytes != options_.channel_bytes) {
    fail("the ranks disagree on the group's size or shm options", false);
  }
  slot(rank_)->pid.store(static_cast<std::int32_t>(getpid()));
  header_->attached.fetch_add(1);
  signal();
  wait_until([&] { return header_->attached.load() == static_cast<std::uint32_t>(size_); },
             "not every rank attached to the shared memory in time (" +
                 std::to_string(header_->attached.load()) + " of " + std::to_string(size_) + ")");
  if (rank_ == 0) segment_.unlink();
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

WorkPtr ShmCommunicator::submit(std::shared_ptr<Task> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.empty()) {
      throw CommError(where() + ": " + task->describe() + " refused: the group failed earlier (" +
                      broken_ + "); create a new group");
    }
    task->deadline = Clock::now() + options_.timeout;
    pending_.push_back(task);
    progress_locked();
  }
  return std::make_shared<ShmWork>(shared_from_this(), std::move(task));
}

void ShmCommunicator::progress_locked() {
  if (pending_.empty()) return;
  if (header_->aborted_by.load() >= 0 && broken_.empty()) {
    broken_ = "the group was aborted by rank " + std::to_string(header_->aborted_by.load());
  }
  if (!broken_.empty()) {
    for (auto& t : pending_) {
      t->error = std::make_exception_ptr(
          CommError(where() + ": " + t->describe() + " failed: " + broken_));
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

void ShmCommunicator::wait(const std::shared_ptr<Task>& task) {
  // When every rank has a core, poll before sleeping: a futex wake-up takes tens of
  // microseconds on a VM, and two ranks whose spins are shorter than that fall into a rhythm
  // where every op pays one. Polling yields the core after the first microseconds, so a thread
  // that needs it gets it; past 1 ms the wait sleeps.
  if (spin_) {
    const auto start = Clock::now();
    for (int i = 0; !task->done; ++i) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        progress_locked();
      }
      if (task->done) break;
      if ((i & 15) == 15) {
        const auto spent = Clock::now() - start;
        if (spent > std::chrono::milliseconds(1)) break;
        if (spent > std::chrono::microseconds(20)) sched_yield();
      }
      cpu_relax();
    }
  }
  auto last_check = Clock::now();
  while (!task->done) {
    Sleeper sleeper(header_);
    const std::uint32_t generation = header_->generation.load();
    {
      std::lock_guard<std::mutex> lock(mu_);
      progress_locked();
    }
    if (task->done) break;
    const auto now = Clock::now();
    // Dead peers are looked for a few times a second, not on every wake.
    const bool check_peers = now - last_check > std::chrono::milliseconds(100);
    if (check_peers) last_check = now;
    check_health(*task, check_peers);
    const auto left = task->deadline - now;
    futex_wait(&header_->generation, generation,
               std::min<Clock::duration>(left, std::chrono::milliseconds(100)));
  }
  if (task->error) std::rethrow_exception(task->error);
}

void ShmCommunicator::check_health(const Task& task, bool check_peers) {
  const int aborter = header_->aborted_by.load();
  if (aborter >= 0) {
    fail(task.describe() + " failed: the group was aborted by rank " + std::to_string(aborter),
         false);
  }
  const std::vector<int> peers = task.waiting_on(*this);
  auto names = [&] {
    std::string s;
    for (int q : peers) s += (s.empty() ? "rank " : ", rank ") + std::to_string(q);
    return s.empty() ? std::string("its peers") : s;
  };
  if (check_peers) {
    for (int q : peers) {
      const pid_t pid = slot(q)->pid.load();
      if (q != rank_ && pid > 0 && !process_alive(pid)) {
        fail(task.describe() + " failed: rank " + std::to_string(q) + " (pid " +
                 std::to_string(pid) + ") has exited",
             false);
      }
    }
  }
  if (Clock::now() > task.deadline) {
    fail(task.describe() + " timed out after " + std::to_string(options_.timeout.count()) +
             " ms waiting for " + names(),
         true);
  }
}

void ShmCommunicator::fail(const std::string& message, bool timeout) {
  const std::string full = where() + ": " + message;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_.empty()) broken_ = message;
    progress_locked();  // fails what is pending
  }
  signal();
  if (timeout) throw CommTimeoutError(full);
  throw CommError(full);
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
  // All are queued before any progresses, so the batch moves together.
  std::vector<std::shared_ptr<Task>> tasks;
  for (const P2POp& op : ops) {
    tasks.push_back(op.send ? make_send(op.buffer, rank_, op.peer)
                            : make_recv(op.buffer, rank_, op.peer));
  }
  std::vector<WorkPtr> works;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.empty()) {
      throw CommError(where() + ": point-to-point refused: the group failed earlier (" + broken_ +
                      "); create a new group");
    }
    for (auto& t : tasks) {
      t->deadline = Clock::now() + options_.timeout;
      pending_.push_back(t);
    }
    progress_locked();
  }
  for (auto& t : tasks) works.push_back(std::make_shared<ShmWork>(shared_from_this(), t));
  return works;
}

WorkPtr ShmCommunicator::barrier() { return submit(make_barrier()); }

}  // namespace megart::comm::shm
