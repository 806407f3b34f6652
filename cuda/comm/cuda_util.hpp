// UNVERIFIED: compiled without a GPU and never run.
// Small RAII helpers for the CUDA runtime: the current device, and one completion event.
#pragma once

#include <cuda_runtime.h>

#include <string>

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

// One completion event, shared by the Works of one stream's part of a batch.
class NcclEvent {
 public:
  NcclEvent(cudaEvent_t event, int device) : event_(event), device_(device) {}
  ~NcclEvent() {
    DeviceGuard guard(device_);
    cudaEventDestroy(event_);  // released by CUDA once the recorded work completes
  }
  NcclEvent(const NcclEvent&) = delete;
  NcclEvent& operator=(const NcclEvent&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_;
  int device_;
};

}  // namespace megart::cuda
