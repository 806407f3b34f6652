// Ran on one GPU only, and on the CPU stand-in (tests/standin). Creating and shutting down the
// NCCL communicator of NcclCommunicator: a non-blocking creation bounded by the timeout, the split
// into the blocking communicator the ops use, and a shutdown bounded by the timeout too.
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "comm/cuda_util.hpp"
#include "comm/nccl_api.hpp"
#include "comm/nccl_communicator.hpp"
#include "common/error.hpp"

namespace megart::cuda {

using Clock = std::chrono::steady_clock;

void NcclCommunicator::shut_down_nccl() noexcept {
  // Never throws, never hangs. With work still queued on its streams (a Work dropped unwaited, a
  // peer that never came) or after a failure the communicator is aborted: ncclCommDestroy would
  // wait for that work.
  const bool idle = (send_stream_ == nullptr || cudaStreamQuery(send_stream_) == cudaSuccess) &&
                    (recv_stream_ == nullptr || cudaStreamQuery(recv_stream_) == cudaSuccess);
  cudaGetLastError();
  if (!idle || !broken_.empty()) {
    api_->comm_abort(comm_);
    return;
  }
  // Recent NCCL's ncclCommDestroy of a communicator not yet finalized first meets the group's
  // other ranks on this node (a barrier), with no bound: one rank that never destroys the group,
  // or destroys its groups in another order, would hang this one. ncclCommFinalize does that
  // work first, so the wait for it is bounded by the timeout; past it, or on an error, the
  // communicator is aborted instead.
  if (api_->comm_finalize != nullptr) {
    bool finalized = false;
    if (nonblocking_) {
      finalized = finalize_nonblocking(comm_);
    } else {
      // A blocking communicator's ncclCommFinalize returns only when done: it runs on a helper
      // thread, and past the timeout the communicator is aborted from here (NCCL's documented
      // way out of a stuck call), which ends the helper's call too.
      struct Shared {
        std::mutex mu;
        std::condition_variable cv;
        bool done = false;
        int result = kNcclSuccess;
      };
      auto shared = std::make_shared<Shared>();
      std::thread([shared, api = api_, comm = comm_] {
        const int r = api->comm_finalize(comm);
        std::lock_guard<std::mutex> lock(shared->mu);
        shared->done = true;
        shared->result = r;
        shared->cv.notify_all();
      }).detach();
      std::unique_lock<std::mutex> lock(shared->mu);
      finalized = shared->cv.wait_for(lock, timeout_, [&] { return shared->done; }) &&
                  shared->result == kNcclSuccess;
    }
    if (!finalized) {
      api_->comm_abort(comm_);
      return;
    }
  }
  api_->comm_destroy(comm_);  // after ncclCommFinalize: frees local resources only
}

bool NcclCommunicator::finalize_nonblocking(void* comm) noexcept {
  return settle(api_->comm_finalize(comm), comm) == kNcclSuccess;
}

int NcclCommunicator::settle(int state, void* comm) const {
  return comm::wait_nccl_state(
      state, [&](int* out) { return api_->comm_get_async_error(comm, out); },
      Clock::now() + timeout_);
}

void NcclCommunicator::init_nccl(const NcclUniqueId& id, const std::string& what) {
  NcclUniqueIdC raw{};
  std::memcpy(raw.internal, id.data(), kNcclUniqueIdBytes);
  void* handle = nullptr;
  if (api_->comm_init_rank_config == nullptr) {
    check_nccl(api_->comm_init_rank(&handle, size_, raw, rank_), "ncclCommInitRank", what);
    comm_ = handle;
    return;
  }
  NcclConfig2_14 config;
  config.blocking = 0;
  const NcclResult started = api_->comm_init_rank_config(&handle, size_, raw, rank_, &config);
  // NCCL connects to the other ranks in the background; poll until it has, or time runs out.
  const NcclResult state = handle != nullptr ? settle(started, handle) : started;
  if (state == kNcclInProgress && handle != nullptr) {
    api_->comm_abort(handle);
    throw CommTimeoutError(where() + ": " + what + " timed out after " +
                           std::to_string(timeout_.count()) +
                           " ms in ncclCommInitRankConfig: not every rank of the group joined "
                           "(each must create the group with the same ranks)");
  }
  if (state != kNcclSuccess || handle == nullptr) {
    const std::string text = api_->explain(state, handle);
    if (handle != nullptr) api_->comm_abort(handle);
    throw CommError(where() + ": " + what + " failed: ncclCommInitRankConfig returned " + text);
  }
  comm_ = handle;
  nonblocking_ = true;
  if (api_->comm_split != nullptr) {
    comm_ = split_blocking(handle, what);
    nonblocking_ = false;
  }
}

void* NcclCommunicator::split_blocking(void* parent, const std::string& what) {
  NcclConfig2_14 config;
  config.blocking = 1;
  void* child = nullptr;
  // One color, keys in rank order: the same ranks in the same order. The parent is
  // non-blocking, so the split may answer ncclInProgress: the child's state is polled out, then
  // the parent's (neither may be used before).
  NcclResult state = api_->comm_split(parent, 0, rank_, &child, &config);
  if (state == kNcclInProgress) state = settle(state, child != nullptr ? child : parent);
  if (state == kNcclSuccess) {
    NcclResult parent_state = kNcclSuccess;
    const NcclResult polled = api_->comm_get_async_error(parent, &parent_state);
    state = polled != kNcclSuccess ? polled : settle(parent_state, parent);
  }
  if (state != kNcclSuccess || child == nullptr) {
    const std::string text = state == kNcclInProgress
                                 ? "timed out after " + std::to_string(timeout_.count()) + " ms"
                                 : "failed: " + api_->explain(state, parent);
    if (child != nullptr) api_->comm_abort(child);
    api_->comm_abort(parent);
    throw CommError(where() + ": " + what + ": ncclCommSplit into a blocking communicator " + text);
  }
  // The parent has served its purpose (a creation bounded by the timeout).
  if (finalize_nonblocking(parent)) {
    api_->comm_destroy(parent);
  } else {
    api_->comm_abort(parent);
  }
  return child;
}

}  // namespace megart::cuda
