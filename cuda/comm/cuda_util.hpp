// Ran on one GPU only (see nccl_communicator.hpp).
// Small RAII helpers for the CUDA runtime: the current device, and pooled completion events.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace megart::cuda {

// "cudaErrorInvalidValue (invalid argument)"
inline std::string cuda_text(cudaError_t err) {
  return std::string(cudaGetErrorName(err)) + " (" + cudaGetErrorString(err) + ")";
}

// Makes `device` current and restores the caller's device on scope exit. A failed switch is
// kept in error() rather than thrown, because destructors use the guard too: code that goes on
// to launch work checks it (work on the wrong device would fail later, far from the cause).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      cudaGetLastError();
      previous_ = -1;
    }
    if (previous_ != device) {
      error_ = cudaSetDevice(device);
      if (error_ != cudaSuccess) cudaGetLastError();  // reported through error() instead
    }
  }
  ~DeviceGuard() {
    if (previous_ >= 0 && error_ == cudaSuccess) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

  // cudaSuccess, or why the device could not be made current.
  cudaError_t error() const { return error_; }

 private:
  int previous_ = -1;
  cudaError_t error_ = cudaSuccess;
};

// Completion events of one communicator, reused: creating and destroying a CUDA event per op
// costs host time on every op, and an event can be recorded again once no Work needs its
// previous record (a stream that waits on it has already captured that record).
class EventPool {
 public:
  explicit EventPool(int device) : device_(device) {}
  ~EventPool() {
    DeviceGuard guard(device_);
    for (cudaEvent_t e : free_) cudaEventDestroy(e);
  }
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;

  // A free event, or a new one; cudaSuccess or why none could be made.
  cudaError_t take(cudaEvent_t* event) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        *event = free_.back();
        free_.pop_back();
        return cudaSuccess;
      }
    }
    return cudaEventCreateWithFlags(event, cudaEventDisableTiming);
  }
  void give_back(cudaEvent_t event) {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.size() < kKeep) {
      free_.push_back(event);
      return;
    }
    DeviceGuard guard(device_);
    cudaEventDestroy(event);  // released by CUDA once the recorded work completes
  }
  int device() const { return device_; }

 private:
  static constexpr std::size_t kKeep = 256;  // more than the ops a rank keeps in flight
  int device_;
  std::mutex mu_;
  std::vector<cudaEvent_t> free_;
};

// One completion event, shared by the Works of one stream's part of a batch; back to its pool
// when the last of them is gone.
class NcclEvent {
 public:
  NcclEvent(cudaEvent_t event, std::shared_ptr<EventPool> pool)
      : event_(event), pool_(std::move(pool)) {}
  ~NcclEvent() { pool_->give_back(event_); }
  NcclEvent(const NcclEvent&) = delete;
  NcclEvent& operator=(const NcclEvent&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_;
  std::shared_ptr<EventPool> pool_;
};

}  // namespace megart::cuda
