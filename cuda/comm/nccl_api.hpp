// UNVERIFIED: compiled without a GPU and never run.
// The part of NCCL's C API megart calls, looked up at run time in the loaded library. The few
// types it needs are declared here (no nccl.h at build time): the communicator is an opaque
// pointer, the unique id 128 bytes passed by value, results, data types and reductions ints.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "comm/nccl_communicator.hpp"
#include "comm/nccl_library.hpp"

namespace megart::cuda {

struct NcclUniqueIdC {
  char internal[kNcclUniqueIdBytes];
};
using NcclResult = int;
constexpr NcclResult kNcclSuccess = 0;
constexpr NcclResult kNcclInProgress = 7;
// NCCL's data type and reduction values (nccl.h's ncclDataType_t and ncclRedOp_t).
constexpr int kNcclUint8 = 1, kNcclInt32 = 2, kNcclInt64 = 4, kNcclFloat16 = 6, kNcclFloat32 = 7,
              kNcclFloat64 = 8, kNcclBfloat16 = 9;
constexpr int kNcclSum = 0, kNcclMax = 2, kNcclMin = 3, kNcclAvg = 4;
// ncclAvg and ncclBfloat16 arrived in NCCL 2.10 (version code 21000).
constexpr int kNccl2_10 = 21000;

struct NcclApi {
  NcclResult (*get_unique_id)(NcclUniqueIdC*) = nullptr;
  NcclResult (*comm_init_rank)(void**, int, NcclUniqueIdC, int) = nullptr;
  NcclResult (*comm_destroy)(void*) = nullptr;
  NcclResult (*comm_abort)(void*) = nullptr;
  NcclResult (*comm_get_async_error)(void*, NcclResult*) = nullptr;
  const char* (*get_error_string)(NcclResult) = nullptr;
  const char* (*get_last_error)(void*) = nullptr;  // NCCL 2.13 and later; may stay null
  NcclResult (*all_reduce)(const void*, void*, std::size_t, int, int, void*,
                           cudaStream_t) = nullptr;
  NcclResult (*all_gather)(const void*, void*, std::size_t, int, void*, cudaStream_t) = nullptr;
  NcclResult (*reduce_scatter)(const void*, void*, std::size_t, int, int, void*,
                               cudaStream_t) = nullptr;
  NcclResult (*broadcast)(const void*, void*, std::size_t, int, int, void*, cudaStream_t) = nullptr;
  NcclResult (*send)(const void*, std::size_t, int, int, void*, cudaStream_t) = nullptr;
  NcclResult (*recv)(void*, std::size_t, int, int, void*, cudaStream_t) = nullptr;
  NcclResult (*group_start)() = nullptr;
  NcclResult (*group_end)() = nullptr;

  explicit NcclApi(const comm::NcclLibrary& lib);
  // "NCCL result 5 (invalid usage); NCCL's last error: ..."
  std::string explain(NcclResult result, void* comm) const;
};

}  // namespace megart::cuda
