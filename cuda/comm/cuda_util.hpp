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

// Restores the caller's current device on scope exit.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      cudaGetLastError();
      previous_ = -1;
    }
    if (previous_ != device) cudaSetDevice(device);
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
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
