// Ran on one GPU only (see nccl_communicator.hpp).
// The part of NCCL's C API megart calls, looked up at run time in the loaded library. The few
// types it needs are declared here (no nccl.h at build time): the communicator is an opaque
// pointer, the unique id 128 bytes passed by value, results, data types and reductions ints.
// tests/nccl_abi/check.cpp checks every declaration here against nccl.h (a wrong signature
// through dlsym would be silent undefined behaviour).
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
static_assert(sizeof(NcclUniqueIdC) == 128, "nccl.h: ncclUniqueId is 128 bytes, passed by value");
using NcclResult = int;
using comm::kNcclInProgress;
using comm::kNcclSuccess;
// NCCL's data type and reduction values (nccl.h's ncclDataType_t and ncclRedOp_t).
constexpr int kNcclUint8 = 1, kNcclInt32 = 2, kNcclInt64 = 4, kNcclFloat16 = 6, kNcclFloat32 = 7,
              kNcclFloat64 = 8, kNcclBfloat16 = 9;
constexpr int kNcclSum = 0, kNcclMax = 2, kNcclMin = 3, kNcclAvg = 4;
// ncclAvg and ncclBfloat16 arrived in NCCL 2.10 (version code 21000).
constexpr int kNccl2_10 = 21000;
// ncclCommInitRankConfig, ncclCommFinalize and non-blocking communicators arrived in NCCL 2.14.
constexpr int kNccl2_14 = 21400;
// ncclCommSplit arrived in NCCL 2.18.
constexpr int kNccl2_18 = 21800;

// NCCL's ncclConfig_t as NCCL 2.14 defined it, field for field: a size, a magic number, the
// version the caller was written for, then `blocking`. NCCL_CONFIG_INITIALIZER fills them with
// sizeof, 0xcafebeef, the header's version and "undefined" (INT_MIN). NCCL reads `size` first
// and copies only that many bytes over its own defaults, and it ignores fields newer than
// `version`, so every NCCL from 2.14 on reads this struct correctly (and leaves its later fields
// at their defaults). tests/nccl_abi/check.cpp checks it against nccl.h.
struct NcclConfig2_14 {
  static constexpr int kUndefInt = std::numeric_limits<int>::min();  // NCCL_CONFIG_UNDEF_INT

  std::size_t size = sizeof(NcclConfig2_14);
  unsigned int magic = 0xcafebeef;
  unsigned int version = kNccl2_14;
  int blocking = kUndefInt;
};
static_assert(offsetof(NcclConfig2_14, magic) == 8 && offsetof(NcclConfig2_14, version) == 12 &&
                  offsetof(NcclConfig2_14, blocking) == 16 && sizeof(NcclConfig2_14) == 24,
              "ncclConfig_t (NCCL 2.14) is {size_t size; unsigned magic, version; int blocking}");

struct NcclApi {
  NcclResult (*get_unique_id)(NcclUniqueIdC*) = nullptr;
  NcclResult (*comm_init_rank)(void**, int, NcclUniqueIdC, int) = nullptr;
  // NCCL 2.14 and later; stays null before.
  NcclResult (*comm_init_rank_config)(void**, int, NcclUniqueIdC, int, NcclConfig2_14*) = nullptr;
  NcclResult (*comm_finalize)(void*) = nullptr;  // NCCL 2.14 and later; stays null before
  // NCCL 2.18 and later; stays null before.
  NcclResult (*comm_split)(void*, int, int, void**, NcclConfig2_14*) = nullptr;
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
