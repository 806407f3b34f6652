// Ran on one GPU only. See nccl_communicator.hpp for the design.
#include "comm/nccl_communicator.hpp"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <thread>
#include <type_traits>
#include <utility>

#include "comm/cuda_util.hpp"
#include "comm/nccl_api.hpp"
#include "comm/nccl_watchdog.hpp"
#include "common/error.hpp"

namespace megart::cuda {

using comm::Buffer;
using comm::DType;
using comm::ReduceOp;
using comm::StreamHandle;
using comm::WorkPtr;
using Clock = std::chrono::steady_clock;

namespace {

class NcclWork final : public comm::Work {
 public:
  NcclWork(std::shared_ptr<NcclCommunicator> comm, std::shared_ptr<NcclEvent> event,
           std::string what, std::string peers)
      : comm_(std::move(comm)),
        event_(std::move(event)),
        what_(std::move(what)),
        peers_(std::move(peers)),
        deadline_(Clock::now() + comm_->timeout()) {}

  bool is_completed() override {
    if (done_) return true;
    try {
      done_ = comm_->event_done(event_->get(), what_, peers_);
    } catch (...) {
      error_ = std::current_exception();
      done_ = true;
    }
    return done_;
  }

  void wait() override {
    if (error_) std::rethrow_exception(error_);
    if (done_) return;
    comm_->wait_event(event_->get(), deadline_, what_, peers_);
    done_ = true;
  }

  void wait_stream(StreamHandle stream) override {
    if (error_) std::rethrow_exception(error_);
    DeviceGuard guard(comm_->device());
    if (guard.error() != cudaSuccess) {
      throw CommError(what_ + ": cudaSetDevice(" + std::to_string(comm_->device()) +
                      ") failed: " + cuda_text(guard.error()));
    }
    const cudaError_t err =
        cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream), event_->get(), 0);
    if (err != cudaSuccess) {
      cudaGetLastError();
      throw CommError(what_ + ": cudaStreamWaitEvent on stream " + std::to_string(stream) +
                      " failed: " + cuda_text(err));
    }
  }

 private:
  std::shared_ptr<NcclCommunicator> comm_;
  std::shared_ptr<NcclEvent> event_;
  std::string what_;
  std::string peers_;
  Clock::time_point deadline_;
  std::atomic<bool> done_{false};
  std::exception_ptr error_;
};

}  // namespace

NcclCommunicator::NcclCommunicator(std::shared_ptr<const NcclApi> api, int version_code,
                                   std::string group_name, int rank, int size, int device,
                                   std::chrono::milliseconds timeout)
    : api_(std::move(api)),
      version_code_(version_code),
      group_name_(std::move(group_name)),
      rank_(rank),
      size_(size),
      device_(device),
      timeout_(timeout),
      sent_(static_cast<std::size_t>(size)),
      events_(std::make_shared<EventPool>(device)) {}

std::shared_ptr<NcclCommunicator> NcclCommunicator::create(const comm::NcclLibrary& library,
                                                           const NcclUniqueId& id, int rank,
                                                           int size, int device,
                                                           std::chrono::milliseconds timeout,
                                                           std::string group_name) {
  const std::string who = "rank " + std::to_string(rank) + " of group '" + group_name + "'";
  if (size < 1 || rank < 0 || rank >= size) {
    throw ConfigError("nccl communicator for " + who + ": need 0 <= rank < size, got rank " +
                      std::to_string(rank) + " and size " + std::to_string(size));
  }
  if (timeout.count() <= 0) {
    throw ConfigError("nccl communicator for " + who + ": the timeout must be positive");
  }
  int devices = 0;
  const cudaError_t count_err = cudaGetDeviceCount(&devices);
  if (count_err != cudaSuccess) {
    cudaGetLastError();
    throw CommError("nccl communicator for " + who + ": no CUDA device is usable (" +
                    cuda_text(count_err) + ")");
  }
  if (device < 0 || device >= devices) {
    throw ConfigError("nccl communicator for " + who + ": device " + std::to_string(device) +
                      " does not exist; this process sees " + std::to_string(devices) +
                      " CUDA device(s)");
  }
  auto api = std::make_shared<const NcclApi>(library);
  const int version = library.version_code();
  std::shared_ptr<NcclCommunicator> c(
      new NcclCommunicator(api, version, std::move(group_name), rank, size, device, timeout));

  DeviceGuard guard(device);
  const std::string what = "creating the communicator";
  c->check_cuda(guard.error(), c->set_device_call(), what);
  c->init_nccl(id, what);
  // Non-blocking streams: they never synchronise with the legacy default stream on their own;
  // ordering with the caller's stream is explicit (events).
  c->check_cuda(cudaStreamCreateWithFlags(&c->send_stream_, cudaStreamNonBlocking),
                "cudaStreamCreateWithFlags", what);
  c->check_cuda(cudaStreamCreateWithFlags(&c->recv_stream_, cudaStreamNonBlocking),
                "cudaStreamCreateWithFlags", what);
  c->check_cuda(cudaEventCreateWithFlags(&c->caller_ready_, cudaEventDisableTiming),
                "cudaEventCreateWithFlags", what);
  c->check_cuda(cudaMalloc(reinterpret_cast<void**>(&c->barrier_buffer_), sizeof(int)),
                "cudaMalloc", what);
  c->check_cuda(cudaMemset(c->barrier_buffer_, 0, sizeof(int)), "cudaMemset", what);
  watch(c);
  return c;
}

NcclCommunicator::~NcclCommunicator() {
  DeviceGuard guard(device_);
  if (comm_ != nullptr && !aborted_) shut_down_nccl();
  if (barrier_buffer_ != nullptr) cudaFree(barrier_buffer_);
  if (caller_ready_ != nullptr) cudaEventDestroy(caller_ready_);
  if (send_stream_ != nullptr) cudaStreamDestroy(send_stream_);
  if (recv_stream_ != nullptr) cudaStreamDestroy(recv_stream_);
  cudaGetLastError();
}

std::string NcclCommunicator::where() const {
  return "rank " + std::to_string(rank_) + " of group '" + group_name_ + "' (size " +
         std::to_string(size_) + ", nccl on cuda:" + std::to_string(device_) + ")";
}

void NcclCommunicator::check_usable(const std::string& what) const {
  if (!broken_.empty()) {
    throw CommError(where() + ": " + what + " refused: the group failed earlier (" + broken_ +
                    "); create a new group");
  }
}

void NcclCommunicator::check_buffer(const Buffer& b, const std::string& what) const {
  if (b.count > 0 && b.data == nullptr) {
    throw ConfigError(where() + ": " + what + ": a buffer of " + std::to_string(b.count) +
                      " elements has no data");
  }
  nccl_dtype(b.dtype, what);
}

int NcclCommunicator::nccl_dtype(DType t, const std::string& what) const {
  switch (t) {
    case DType::Float32:
      return kNcclFloat32;
    case DType::Float16:
      return kNcclFloat16;
    case DType::BFloat16:
      if (version_code_ < kNccl2_10) {
        throw ConfigError(where() + ": " + what + ": bfloat16 needs NCCL 2.10 or later; this is " +
                          comm::nccl_version_string(version_code_));
      }
      return kNcclBfloat16;
    case DType::Float64:
      return kNcclFloat64;
    case DType::Int32:
      return kNcclInt32;
    case DType::Int64:
      return kNcclInt64;
    case DType::UInt8:
      return kNcclUint8;
  }
  throw ConfigError(where() + ": " + what + ": unknown dtype");
}

int NcclCommunicator::nccl_op(ReduceOp op, const std::string& what) const {
  switch (op) {
    case ReduceOp::Sum:
      return kNcclSum;
    case ReduceOp::Avg:
      if (version_code_ < kNccl2_10) {
        throw ConfigError(where() + ": " + what + ": avg needs NCCL 2.10 or later; this is " +
                          comm::nccl_version_string(version_code_) + " (use sum and divide)");
      }
      return kNcclAvg;
    case ReduceOp::Max:
      return kNcclMax;
    case ReduceOp::Min:
      return kNcclMin;
  }
  throw ConfigError(where() + ": " + what + ": unknown reduction");
}

void NcclCommunicator::check_nccl(int result, const std::string& call, const std::string& what) {
  if (result == kNcclInProgress && nonblocking_ && comm_ != nullptr) {
    result = settle(result, comm_);
    if (result == kNcclInProgress) {
      // NCCL forbids the next call before this one is done: the group cannot be used again.
      const std::string reason = what + " timed out after " + std::to_string(timeout_.count()) +
                                 " ms: " + call + " was still in progress";
      break_group(reason);
      throw CommTimeoutError(where() + ": " + reason +
                             "; the NCCL communicator was aborted on this rank");
    }
  }
  if (result == kNcclSuccess) return;
  // After an error the communicator's state is in doubt (an asynchronous error stays its state
  // for good), and megart checked every argument before calling, so an error here is not the
  // caller's to fix by retrying: the group is closed either way.
  const std::string reason =
      what + " failed: " + call + " returned " + api_->explain(result, comm_);
  break_group(reason);
  throw CommError(where() + ": " + reason);
}

std::string NcclCommunicator::set_device_call() const {
  return "cudaSetDevice(" + std::to_string(device_) + ")";
}

void NcclCommunicator::check_cuda(cudaError_t err, const std::string& call,
                                  const std::string& what) const {
  if (err == cudaSuccess) return;
  cudaGetLastError();  // clear a non-sticky error so the next call does not report it
  throw CommError(where() + ": " + what + " failed: " + call + " returned " + cuda_text(err));
}

void NcclCommunicator::after_caller(StreamHandle caller, cudaStream_t stream,
                                    const std::string& what) {
  check_cuda(cudaEventRecord(caller_ready_, reinterpret_cast<cudaStream_t>(caller)),
             "cudaEventRecord on the caller's stream", what);
  check_cuda(cudaStreamWaitEvent(stream, caller_ready_, 0), "cudaStreamWaitEvent", what);
}

std::shared_ptr<NcclEvent> NcclCommunicator::record(cudaStream_t stream, const std::string& what) {
  cudaEvent_t event = nullptr;
  check_cuda(events_->take(&event), "cudaEventCreateWithFlags", what);
  auto owned = std::make_shared<NcclEvent>(event, events_);
  check_cuda(cudaEventRecord(event, stream), "cudaEventRecord", what);
  return owned;
}

WorkPtr NcclCommunicator::make_work(std::shared_ptr<NcclEvent> event, std::string what,
                                    std::string peers) {
  {
    std::lock_guard<std::mutex> lock(flight_mu_);
    // Completed ops leave from the front here too, so the list stays short without a watchdog.
    std::size_t done = 0;
    while (done < in_flight_.size() &&
           cudaEventQuery(in_flight_[done].event->get()) == cudaSuccess) {
      ++done;
    }
    cudaGetLastError();
    in_flight_.erase(in_flight_.begin(), in_flight_.begin() + static_cast<std::ptrdiff_t>(done));
    in_flight_.push_back({event, Clock::now() + timeout_, what, peers});
  }
  return std::make_shared<NcclWork>(shared_from_this(), std::move(event), std::move(what),
                                    std::move(peers));
}

std::string NcclCommunicator::check_health() {
  std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
  if (!lock.owns_lock() || !broken_.empty() || comm_ == nullptr) return "";
  DeviceGuard guard(device_);
  if (guard.error() != cudaSuccess) return "";
  std::string reason;
  std::string oldest_what, oldest_peers;
  {
    std::lock_guard<std::mutex> flight(flight_mu_);
    const auto now = Clock::now();
    std::vector<InFlight> pending;
    for (auto& op : in_flight_) {
      const cudaError_t q = cudaEventQuery(op.event->get());
      if (q == cudaSuccess) continue;
      if (q != cudaErrorNotReady && reason.empty()) {
        cudaGetLastError();
        reason = op.what + " (peers " + op.peers + ") failed on the device: " + cuda_text(q);
      }
      if (now > op.deadline && reason.empty()) {
        reason = op.what + " timed out after " + std::to_string(timeout_.count()) +
                 " ms waiting for " + op.peers;
      }
      if (oldest_what.empty()) oldest_what = op.what, oldest_peers = op.peers;
      pending.push_back(std::move(op));
    }
    in_flight_.swap(pending);
  }
  if (reason.empty()) {
    NcclResult async = kNcclSuccess;
    const NcclResult polled = api_->comm_get_async_error(comm_, &async);
    if (polled != kNcclSuccess || (async != kNcclSuccess && async != kNcclInProgress)) {
      const NcclResult bad = polled != kNcclSuccess ? polled : async;
      reason = (oldest_what.empty() ? std::string("the group")
                                    : oldest_what + " (peers " + oldest_peers + ")") +
               " failed: NCCL reported " + api_->explain(bad, comm_);
    }
  }
  if (reason.empty()) return "";
  break_group(reason);
  return where() + ": " + reason + "; the NCCL communicator was aborted on this rank";
}

void NcclCommunicator::break_group(const std::string& reason) {
  // Caller holds mu_.
  if (broken_.empty()) broken_ = reason;
  if (!aborted_ && comm_ != nullptr) {
    DeviceGuard guard(device_);
    api_->comm_abort(comm_);  // stops this rank's kernels of the group; frees the communicator
    aborted_ = true;
  }
}

bool NcclCommunicator::event_done(cudaEvent_t event, const std::string& what,
                                  const std::string& peers) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!broken_.empty()) {
    throw CommError(where() + ": " + what + " failed: " + broken_);
  }
  DeviceGuard guard(device_);
  check_cuda(guard.error(), set_device_call(), what);
  const cudaError_t q = cudaEventQuery(event);
  if (q == cudaSuccess) return true;
  if (q != cudaErrorNotReady) {
    cudaGetLastError();
    const std::string reason = what + " failed on the device: " + cuda_text(q);
    break_group(reason);
    throw CommError(where() + ": " + reason);
  }
  NcclResult async = kNcclSuccess;
  const NcclResult polled = api_->comm_get_async_error(comm_, &async);
  if (polled != kNcclSuccess || (async != kNcclSuccess && async != kNcclInProgress)) {
    const NcclResult bad = polled != kNcclSuccess ? polled : async;
    const std::string reason =
        what + " failed (peers " + peers + "): NCCL reported " + api_->explain(bad, comm_);
    break_group(reason);
    throw CommError(where() + ": " + reason);
  }
  return false;
}

void NcclCommunicator::wait_event(cudaEvent_t event, Clock::time_point deadline,
                                  const std::string& what, const std::string& peers) {
  // Sleeps between polls, from 5 us growing to 1 ms, so a waiting host thread leaves its core
  // to others; the added latency is at most about the op's time.
  auto pause = std::chrono::microseconds(5);
  while (!event_done(event, what, peers)) {
    if (Clock::now() > deadline) {
      std::lock_guard<std::mutex> lock(mu_);
      const std::string reason = what + " timed out after " + std::to_string(timeout_.count()) +
                                 " ms waiting for " + peers;
      break_group(reason);
      throw CommTimeoutError(where() + ": " + reason +
                             "; the NCCL communicator was aborted on this rank");
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
}

}  // namespace megart::cuda
