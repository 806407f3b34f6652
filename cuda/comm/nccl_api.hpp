// UNVERIFIED: compiled without a GPU and never run.
// The part of NCCL's C API megart calls, looked up at run time in the loaded library. The few
// types it needs are declared here (no nccl.h at build time): the communicator is an opaque
// pointer, the unique id 128 bytes passed by value, results, data types and reductions ints.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <limits>
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
// ncclCommInitRankConfig and non-blocking communicators arrived in NCCL 2.14.
constexpr int kNccl2_14 = 21400;

// The fields of NCCL's ncclConfig_t as NCCL 2.14 defined them (nccl.h's NCCL_CONFIG_INITIALIZER
// values: a magic number, the version the struct follows, every attribute undefined). NCCL
// reads `size` first and copies that many bytes over its own defaults, so a later NCCL, whose
// struct has grown, keeps its defaults for the fields added since.
struct NcclConfig2_14 {
  std::size_t size = sizeof(NcclConfig2_14);
  unsigned int magic = 0xcafebeef;
  unsigned int version = kNccl2_14;
  int blocking = kNcclConfigUndefInt;
  int cga_cluster_size = kNcclConfigUndefInt;
  int min_ctas = kNcclConfigUndefInt;
  int max_ctas = kNcclConfigUndefInt;
  const char* net_name = nullptr;

  static constexpr int kNcclConfigUndefInt = std::numeric_limits<int>::min();
};

struct NcclApi {
  NcclResult (*get_unique_id)(NcclUniqueIdC*) = nullptr;
  NcclResult (*comm_init_rank)(void**, int, NcclUniqueIdC, int) = nullptr;
  // NCCL 2.14 and later; stays null before.
  NcclResult (*comm_init_rank_config)(void**, int, NcclUniqueIdC, int, NcclConfig2_14*) = nullptr;
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
