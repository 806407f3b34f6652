// The shared-memory transport: a Communicator for processes of one machine, on host buffers.
//
// Ops are small non-blocking state machines ("tasks") advanced by whichever thread waits, and
// once when posted, so a message that fits its ring is delivered at once. A thread with nothing
// to do sleeps on a futex in the segment; only when the machine has a core for every rank does
// it poll (yielding the core) for up to a millisecond first.
//
// Ops that nobody waits on (an async all_reduce posted during backward, a receive posted early)
// are advanced by a progress thread, one per communicator, started the first time an op is
// still pending after its post (see progress.cpp). It stands aside while a caller waits (the
// caller progresses everything itself, without a thread hand-off on the latency path) and
// leaves a just-posted op a short grace so that a synchronous op never wakes it.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/communicator.hpp"
#include "comm/shm/layout.hpp"
#include "comm/shm/segment.hpp"

namespace megart::comm::shm {

struct Options {
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};  // every wait, and attaching
  std::size_t staging_bytes = std::size_t{4} << 20;             // per rank
  std::size_t channel_bytes = std::size_t{2} << 20;             // per ordered pair of ranks
  // Per group rank, when known before attaching (exchanged at rendezvous): the process id, so
  // that a peer which dies before it attaches is noticed at once (0: unknown), the global rank,
  // and how errors name the rank ("global rank 2 (tp 0, pp 1, dp 0)"). Empty: "rank q".
  std::vector<std::int32_t> pids;
  std::vector<int> global_ranks;
  std::vector<std::string> labels;
};

class ShmCommunicator;

// The heartbeat of long waits (notice.cpp): how often a blocked wait says whom it waits on
// (MEGART_WAIT_NOTICE_S, default 60 s); whether this process may print one now (at most one
// per interval, whichever group or thread waits); and the one-write line to stderr.
std::chrono::milliseconds wait_notice_interval();
bool claim_wait_notice(std::chrono::steady_clock::time_point now);
void write_stderr_line(const std::string& line);

// One op in flight. step() does what it can without blocking and returns true when finished.
class Task {
 public:
  virtual ~Task() = default;
  virtual bool step(ShmCommunicator& c) = 0;
  virtual bool collective() const = 0;
  // The op as error messages name it: "all_reduce(1024 x float32, sum)".
  virtual std::string describe() const = 0;
  // Group ranks this op is waiting on now (for error messages).
  virtual std::vector<int> waiting_on(const ShmCommunicator& c) const = 0;
  // Point-to-point: (peer, 0 for a send or 1 for a receive). Ops of one lane stream through
  // the same ring end, so only the oldest may move; a send to self and its receive are two lanes.
  virtual std::pair<int, int> lane() const { return {-1, -1}; }

  std::chrono::steady_clock::time_point posted;
  std::chrono::steady_clock::time_point deadline;
  std::uint64_t moved = 0;  // bumped whenever step() advances: the engine goes round again
  std::atomic<bool> done{false};
  std::exception_ptr error;
};

class ShmCommunicator final : public Communicator,
                              public std::enable_shared_from_this<ShmCommunicator> {
 public:
  // Collective over the group: rank 0 creates the segment `shm_name`, the others open it, and
  // all wait (up to the timeout) until every rank has attached; then the name is removed, so
  // nothing is left behind even if a process dies.
  // `board`: the job's world group, whose segment records which rank failed first (so that in
  // a cascade every survivor names the first failure, not a peer that exited after its own
  // error); null: this group's own segment.
  static std::shared_ptr<ShmCommunicator> create(const std::string& shm_name,
                                                 const std::string& group_name, int rank, int size,
                                                 const Options& options = {},
                                                 std::shared_ptr<ShmCommunicator> board = nullptr);
  // Stops and joins the progress thread before the segment is unmapped.
  ~ShmCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return group_name_; }

  // Host memory: the stream arguments are ignored.
  WorkPtr all_reduce(Buffer inout, ReduceOp op, StreamHandle stream) override;
  WorkPtr all_gather(Buffer in, Buffer out, StreamHandle stream) override;
  WorkPtr reduce_scatter(Buffer in, Buffer out, ReduceOp op, StreamHandle stream) override;
  WorkPtr broadcast(Buffer inout, int root, StreamHandle stream) override;
  std::vector<WorkPtr> batch_p2p(const std::vector<P2POp>& ops, StreamHandle stream) override;
  WorkPtr barrier() override;
  void abort() override;
  std::vector<std::uint64_t> bytes_sent() const override;
  void reset_bytes_sent() override;

  // For tasks: the segment, as seen through its layout.
  const Layout& layout() const { return layout_; }
  std::uint8_t* base() const { return segment_.data(); }
  RankSlot* slot(int r) const { return layout_.slot(base(), r); }
  // Reserves `steps` consecutive collective step numbers; returns the first.
  std::uint64_t reserve_steps(std::uint64_t steps);
  // Wakes every process sleeping on this group.
  void signal();
  void count_sent(int peer, std::uint64_t bytes);
  // Whether a message to `peer` at least a ring long goes by a direct read (the receiver
  // copies it from this process with process_vm_readv: one copy instead of two through the
  // ring). On unless MEGART_SHM_DIRECT=0, and off for a peer once it could not read. Caller
  // holds mu_.
  bool direct_to(int peer) const { return direct_[peer]; }
  void no_direct_to(int peer) { direct_[peer] = false; }
  // MEGART_SHM_DIRECT=refuse: receivers answer every direct message as if the system had
  // refused the read, so that tests run the fallback where process_vm_readv is allowed.
  bool refuse_direct() const { return refuse_direct_; }

  // Blocks until `task` finishes, then throws its error if it failed; used by Work::wait.
  void wait(const std::shared_ptr<Task>& task);
  bool poll(const std::shared_ptr<Task>& task);

 private:
  ShmCommunicator(Segment segment, Layout layout, std::string group_name, int rank, int size,
                  const Options& options);
  void attach();
  // Queues `tasks` (refused if the group failed earlier) and advances them once. `what` names
  // them in the refusal; nullptr: the first task's description. Caller holds mu_.
  void post_locked(const std::vector<std::shared_ptr<Task>>& tasks, const char* what);
  WorkPtr submit(std::shared_ptr<Task> task);
  // Advances pending tasks in order: every point-to-point task whose ring is free, and the
  // oldest collective. Caller holds mu_.
  void progress_locked();
  // What is wrong with `task`: the group aborted, a peer it waits on died (looked for only when
  // `check_peers`), or its deadline passed; empty when nothing is. Caller holds mu_.
  std::string health_locked(const Task& task, bool check_peers, bool* timeout) const;
  // Marks the group broken by `message` and fails every pending task; `culprit` gets the message
  // itself (a CommTimeoutError when `timeout`). Caller holds mu_.
  void fail_locked(const std::string& message, bool timeout, Task* culprit);
  // The line a wait prints when `task` has been blocked for `waited` (notice.cpp): this rank,
  // the ranks it waits on (with their coordinates), the op, the group and the time left.
  std::string wait_notice_locked(const Task& task,
                                 std::chrono::steady_clock::duration waited) const;
  std::string where() const;
  // How errors name group rank q (its label, else "rank q").
  std::string label(int q) const;
  // Records group rank q as failed unless a rank failed before it, and says which failed first
  // when that was another rank ("" otherwise).
  std::string note_failure(int q) const;
  // attach() found group rank q's process gone (or the wait timed out): the name is removed so
  // that no segment outlives the job, then `message` is thrown.
  [[noreturn]] void fail_attach(const std::string& message, bool timeout);

  // The progress thread (progress.cpp). Caller of start holds mu_.
  void start_progress_locked();
  void progress_loop();
  enum class ThreadState {
    kBusy,   // advancing tasks, or asleep on the segment's futex
    kAlert,  // asleep with a timer: ops are being posted, or one was just posted
    kIdle,   // asleep until a post notifies it
    kAside,  // asleep while a caller waits (and advances everything); its leaving notifies
  };
  void sleep_locked(std::unique_lock<std::mutex>& lock, ThreadState state,
                    std::optional<std::chrono::nanoseconds> timeout);
  // A waiter leaves: the thread takes over what is still pending.
  void leave_wait();

  Segment segment_;
  Layout layout_;
  Header* header_;
  std::string group_name_;
  int rank_;
  int size_;
  Options options_;
  bool spin_;                               // one core per rank: a short spin before sleeping pays
  std::shared_ptr<ShmCommunicator> board_;  // see create()

  std::mutex mu_;
  std::deque<std::shared_ptr<Task>> pending_;
  std::uint64_t next_step_ = 0;
  std::string broken_;  // set once an op fails: the group cannot be trusted after that
  bool broken_by_timeout_ = false;
  std::vector<std::atomic<std::uint64_t>> sent_;
  std::vector<bool> direct_;                 // see direct_to(); guarded by mu_
  std::vector<std::uint64_t> pair_batches_;  // batches posted with each peer; guarded by mu_
  bool refuse_direct_;

  // The progress thread and what it sleeps on; all guarded by mu_ except `waiting_`.
  std::thread progress_;
  std::condition_variable wake_;
  ThreadState thread_state_ = ThreadState::kBusy;
  bool stop_ = false;
  bool no_thread_ = false;       // none could be started: ops progress only when waited on
  std::uint64_t posts_ = 0;      // ops posted so far: the thread stays alert while it moves
  std::atomic<int> waiting_{0};  // threads inside wait(), which progress everything themselves
};

}  // namespace megart::comm::shm
