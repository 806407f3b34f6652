// Ranks as threads for the stand-in tests: each rank thread makes its own device current (as a
// process per GPU would) and joins one NCCL group through the transport's own create().
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/nccl_communicator.hpp"
#include "comm/nccl_library.hpp"
#include "cuda_runtime.h"
#include "standin.h"
#include "test.hpp"

namespace megart::standin {

using Comm = std::shared_ptr<cuda::NcclCommunicator>;

inline std::string nccl_path() {
  const char* env = std::getenv("MEGART_NCCL_LIBRARY");
  return env != nullptr ? env : MEGART_STANDIN_NCCL;
}

inline const comm::NcclLibrary& library() {
  static const comm::NcclLibrary lib = comm::NcclLibrary::load({nccl_path()});
  return lib;
}

inline cuda::NcclUniqueId new_id() { return cuda::nccl_unique_id(library()); }

// The NCCL stand-in's own controls, found in the loaded library as the transport finds NCCL's.
// Every communicator on `device` acts as if its process had exited.
inline void kill_device(int device) {
  reinterpret_cast<void (*)(int)>(library().symbol("megartStandinKillDevice"))(device);
}
// Calls that ran in a background thread of a non-blocking communicator so far.
inline unsigned long long async_calls() {
  return reinterpret_cast<unsigned long long (*)()>(library().symbol("megartStandinAsyncCalls"))();
}

inline Comm create(const cuda::NcclUniqueId& id, int rank, int size, int device,
                   std::chrono::milliseconds timeout = std::chrono::seconds(20),
                   const std::string& name = "world") {
  cudaSetDevice(device);
  return cuda::NcclCommunicator::create(library(), id, rank, size, device, timeout, name);
}

// Runs body(rank) on `size` threads (rank r on device devices[r], or r) and joins them.
inline void run_ranks(int size, const std::function<void(int)>& body,
                      std::vector<int> devices = {}) {
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    const int device = devices.empty() ? r : devices[r];
    threads.emplace_back([&, r, device] {
      cudaSetDevice(device);
      try {
        body(r);
      } catch (const std::exception& e) {
        test::fail(__FILE__, __LINE__, "rank " + std::to_string(r) + ": " + e.what());
      }
    });
  }
  for (auto& t : threads) t.join();
}

inline comm::StreamHandle handle(cudaStream_t s) { return reinterpret_cast<comm::StreamHandle>(s); }

inline cudaStream_t new_stream() {
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  return s;
}

// A "kernel" on `stream`: runs fn on the stream's worker, in stream order.
inline void launch(cudaStream_t stream, std::function<void()> fn) {
  auto* task = new std::function<void()>(std::move(fn));
  cudaLaunchHostFunc(
      stream,
      [](void* p) {
        std::unique_ptr<std::function<void()>> f(static_cast<std::function<void()>*>(p));
        (*f)();
      },
      task);
}

// Device memory of the current device, freed on scope exit.
struct DeviceBuffer {
  explicit DeviceBuffer(std::size_t bytes) : bytes(bytes) { cudaMalloc(&ptr, bytes); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* ptr = nullptr;
  std::size_t bytes;
};

}  // namespace megart::standin
