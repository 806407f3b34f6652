// The nccl transport: a Communicator on device memory through NCCL, which is loaded at run time
// (comm/nccl_library.hpp), so nothing here needs nccl.h to build and nothing links libnccl.
//
// Ran on one H200 (2026-11-26), NCCL 2.28.9: tests/test_nccl.py passes there (one rank, and two
// ranks sharing the GPU); never between GPUs (NVLink, InfiniBand).
//
// Streams. The communicator owns two non-blocking CUDA streams on its device:
//   - the send stream, which carries sends and every collective (and the barrier);
//   - the receive stream, which carries receives.
// Ops that must progress together belong in one batch_p2p (one NCCL group), which is what the
// Python layer does for batch_isend_irecv; NCCL joins the streams of a group around its one
// kernel. Ops posted in separate calls do NOT progress together, whatever their streams: NCCL
// orders each kernel launch of a communicator after the previous one through an internal
// stream (its enqueue code does so in every recent version read for this), so a lone isend
// posted before an irecv, on two ranks that exchange data, can deadlock once the message
// outgrows NCCL's buffers, as in torch.distributed. Separate streams only keep the caller's
// other streams free. A send or receive to this rank itself needs its matching op in the same
// batch (NCCL answers ncclInvalidUsage otherwise).
//
// Ordering. Each op first makes its NCCL stream wait on an event recorded on the caller's stream
// (passed as a handle; 0 is the legacy default stream), so inputs produced there are ready, and
// records a completion event after the op (events come from a per-communicator pool). Work::wait()
// polls that event and NCCL's asynchronous error on the host with short sleeps, and past the
// timeout aborts the communicator (so no kernel spins forever) and raises CommTimeoutError;
// Work::wait_stream(s) makes `s` wait on the event without blocking the host.
//
// Failures nobody waits for. Every op stays on the communicator's in-flight list until its event
// completes; the process's watchdog (nccl_watchdog.hpp) polls that list and NCCL's asynchronous
// error, and ends the process naming the op when a peer fails or an op outlives the timeout.
//
// Blocking and non-blocking. The communicator is created non-blocking (NCCL 2.14+), so that a
// rank that never joins is a timeout, not a hang. From NCCL 2.23 every call on a non-blocking
// communicator runs in a new NCCL thread and answers ncclInProgress, which costs tens of
// microseconds of host time per op; so, with NCCL 2.18+, the ready communicator is split once
// into a blocking one (same ranks, same order) that carries every op, and the non-blocking one
// is finalized and destroyed. Shutting the blocking one down is bounded by the timeout too.
//
// Lifetime. The buffers of an op must stay allocated until it completes: the Python layer keeps
// its tensors referenced from its Work (and, after wait_stream or when the Work is dropped
// unfinished, from the group) until then. A Work keeps its communicator alive.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/communicator.hpp"
#include "comm/nccl_library.hpp"

namespace megart::cuda {

// NCCL's unique id: 128 opaque bytes made by ncclGetUniqueId on one rank and shared with the
// others (megart shares it through torch's TCPStore).
constexpr std::size_t kNcclUniqueIdBytes = 128;
using NcclUniqueId = std::array<char, kNcclUniqueIdBytes>;

// ncclGetUniqueId through `library`; works without a GPU.
NcclUniqueId nccl_unique_id(const comm::NcclLibrary& library);

// The NCCL functions megart calls, looked up once with NcclLibrary::symbol.
struct NcclApi;
// A CUDA event that marks the end of an op on one of the communicator's streams.
class NcclEvent;

class EventPool;

class NcclCommunicator final : public comm::Communicator,
                               public std::enable_shared_from_this<NcclCommunicator> {
 public:
  // Collective over the group: every rank calls it with the same unique id. Selects `device`
  // (restoring the caller's current device afterwards), creates the NCCL communicator (see
  // init_nccl: bounded by the timeout with NCCL 2.14 and later), the two streams and a small
  // device buffer for barrier(). `timeout` bounds every wait.
  static std::shared_ptr<NcclCommunicator> create(const comm::NcclLibrary& library,
                                                  const NcclUniqueId& id, int rank, int size,
                                                  int device, std::chrono::milliseconds timeout,
                                                  std::string group_name);
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return group_name_; }
  int device() const { return device_; }
  int nccl_version_code() const { return version_code_; }

  comm::WorkPtr all_reduce(comm::Buffer inout, comm::ReduceOp op,
                           comm::StreamHandle stream) override;
  comm::WorkPtr all_gather(comm::Buffer in, comm::Buffer out, comm::StreamHandle stream) override;
  comm::WorkPtr reduce_scatter(comm::Buffer in, comm::Buffer out, comm::ReduceOp op,
                               comm::StreamHandle stream) override;
  comm::WorkPtr broadcast(comm::Buffer inout, int root, comm::StreamHandle stream) override;
  // One NCCL group (ncclGroupStart/End): sends on the send stream, receives on the receive
  // stream. Returns one Work per op; a Work waits for its own stream's part of the group.
  std::vector<comm::WorkPtr> batch_p2p(const std::vector<comm::P2POp>& ops,
                                       comm::StreamHandle stream) override;
  // An all-reduce of one int32 on the send stream; wait() on its Work is the host barrier.
  comm::WorkPtr barrier() override;
  // ncclCommAbort: ops in flight on this rank stop and their waits raise CommError. Other ranks
  // are not told; their waits end with NCCL's remote error or at their timeout.
  void abort() override;
  // Bytes of sends posted to each group rank (counted when posted: the host does not see NCCL's
  // progress).
  std::vector<std::uint64_t> bytes_sent() const override;
  void reset_bytes_sent() override;

  cudaStream_t send_stream() const { return send_stream_; }
  cudaStream_t recv_stream() const { return recv_stream_; }

  // For NcclWork. Blocks until `event` has completed, polling NCCL's asynchronous error; on an
  // error or past `deadline` aborts the communicator and throws (CommTimeoutError for the
  // timeout), naming this rank, `what` (the op), `peers` and the group.
  void wait_event(cudaEvent_t event, std::chrono::steady_clock::time_point deadline,
                  const std::string& what, const std::string& peers);
  // Non-blocking: true when `event` has completed; throws as wait_event does on an error.
  bool event_done(cudaEvent_t event, const std::string& what, const std::string& peers);
  std::chrono::milliseconds timeout() const { return timeout_; }
  // True when ops run on a blocking communicator (see the top of this file).
  bool blocking_ops() const { return comm_ != nullptr && !nonblocking_; }

  // For the watchdog: forgets completed ops, and on NCCL's asynchronous error, a failed event or
  // an op past its deadline breaks (aborts) the group and returns what failed, naming the op,
  // its peers, this rank and the group; "" when all is well, when the group already failed (its
  // error was raised to the caller) or when an op is being posted right now (checked next time).
  std::string check_health();

 private:
  NcclCommunicator(std::shared_ptr<const NcclApi> api, int version_code, std::string group_name,
                   int rank, int size, int device, std::chrono::milliseconds timeout);

  // "rank 1 of group 'world' (size 8, nccl, cuda:1)"
  std::string where() const;
  // Throws CommError if the group failed or was aborted earlier.
  void check_usable(const std::string& what) const;
  void check_buffer(const comm::Buffer& b, const std::string& what) const;
  int nccl_dtype(comm::DType t, const std::string& what) const;
  int nccl_op(comm::ReduceOp op, const std::string& what) const;
  // Creates comm_. With NCCL 2.14 or later the communicator is non-blocking, so
  // that creation is bounded by the timeout: a rank that never joins gives a CommTimeoutError
  // (and the half-made communicator is aborted) instead of a hang; with 2.18 or later it is then
  // split into the blocking communicator the ops use. Older NCCL has only the blocking
  // ncclCommInitRank, which waits for every rank however long it takes.
  void init_nccl(const NcclUniqueId& id, const std::string& what);
  // ncclCommSplit of the ready non-blocking `parent` into a blocking communicator; finalizes and
  // destroys the parent. Throws (aborting both) on an error or past the timeout.
  void* split_blocking(void* parent, const std::string& what);
  // On a non-blocking communicator any call may answer ncclInProgress while NCCL finishes it in
  // the background (a group's kernels are not even on their streams yet); that is polled out
  // first, up to the timeout, as NCCL requires before the next call or any use of the streams.
  // Then, when the result is not success, breaks the group (caller holds mu_) and throws
  // CommError with NCCL's error string and last error (CommTimeoutError past the timeout).
  void check_nccl(int result, const std::string& call, const std::string& what);
  // comm::wait_nccl_state on `comm` (ncclCommGetAsyncError), up to the timeout from now.
  int settle(int state, void* comm) const;
  // The destructor's part for comm_ (not yet aborted): ncclCommFinalize, bounded by the
  // timeout, then ncclCommDestroy; ncclCommAbort when work is still queued, the group failed,
  // or finalizing does not finish in time.
  void shut_down_nccl() noexcept;
  // ncclCommFinalize of a non-blocking communicator, polled up to the timeout.
  bool finalize_nonblocking(void* comm) noexcept;
  void check_cuda(cudaError_t err, const std::string& call, const std::string& what) const;
  std::string set_device_call() const;  // "cudaSetDevice(N)", for check_cuda
  // Makes `stream` wait on the work queued so far on the caller's stream.
  void after_caller(comm::StreamHandle caller, cudaStream_t stream, const std::string& what);
  // Records a completion event on `stream` (after the op just posted there).
  std::shared_ptr<NcclEvent> record(cudaStream_t stream, const std::string& what);
  // The Work of an op whose completion `event` marks; the op joins the in-flight list.
  comm::WorkPtr make_work(std::shared_ptr<NcclEvent> event, std::string what, std::string peers);
  // What every collective does around its NCCL call: lock, check the group, order the send
  // stream after the caller's, enqueue (`enqueue` returns NCCL's result), record the event.
  template <typename Enqueue>
  comm::WorkPtr collective(const std::string& what, comm::StreamHandle caller, const char* call,
                           std::string peers, Enqueue enqueue);
  // Marks the group broken with `reason` and aborts the NCCL communicator (once).
  void break_group(const std::string& reason);

  std::shared_ptr<const NcclApi> api_;
  int version_code_;
  std::string group_name_;
  int rank_;
  int size_;
  int device_;
  std::chrono::milliseconds timeout_;

  void* comm_ = nullptr;      // ncclComm_t
  bool nonblocking_ = false;  // made with ncclConfig_t.blocking = 0 (NCCL 2.14 and later)
  cudaStream_t send_stream_ = nullptr;
  cudaStream_t recv_stream_ = nullptr;
  cudaEvent_t caller_ready_ = nullptr;  // re-recorded on the caller's stream by every op
  int* barrier_buffer_ = nullptr;       // one int32 on the device

  // Guards comm_ against use after ncclCommAbort, the posting of ops (NCCL calls on one
  // communicator from several host threads must not interleave) and broken_.
  mutable std::mutex mu_;
  std::string broken_;  // set once an op fails or the group is aborted
  bool aborted_ = false;
  std::vector<std::atomic<std::uint64_t>> sent_;

  std::shared_ptr<EventPool> events_;
  struct InFlight {
    std::shared_ptr<NcclEvent> event;
    std::chrono::steady_clock::time_point deadline;
    std::string what, peers;
  };
  std::mutex flight_mu_;  // guards in_flight_ (the watchdog reads it without mu_)
  std::vector<InFlight> in_flight_;
};

}  // namespace megart::cuda
