// Compile-only check (tests/test_nccl.py builds it with -fsyntax-only against an nccl.h) that
// megart's run-time declarations of NCCL (cuda/comm/nccl_api.hpp, which does not include nccl.h)
// match NCCL's: a wrong signature through dlsym would be silent undefined behaviour. Every
// function pointer of NcclApi must have the type of its NCCL function once NCCL's types are
// replaced by megart's stand-ins (the communicator a void*, enums int, the unique id and config
// megart's structs), the values megart sends must be NCCL's, and megart's config must lay out as
// the start of ncclConfig_t with NCCL_CONFIG_INITIALIZER's values.
#include <nccl.h>

#include <cstddef>
#include <type_traits>

#include "comm/nccl_api.hpp"

namespace megart::cuda {
namespace {

// NCCL's type -> the type megart declares in its place.
template <typename T>
struct Abi {
  using type = T;
};
template <typename T>
using abi_t = typename Abi<T>::type;
#define MEGART_ABI(nccl_type, megart_type) \
  template <>                              \
  struct Abi<nccl_type> {                  \
    using type = megart_type;              \
  }
MEGART_ABI(ncclComm_t, void*);
MEGART_ABI(ncclComm_t*, void**);
MEGART_ABI(ncclResult_t, NcclResult);
MEGART_ABI(ncclResult_t*, NcclResult*);
MEGART_ABI(ncclDataType_t, int);
MEGART_ABI(ncclRedOp_t, int);
MEGART_ABI(ncclUniqueId, NcclUniqueIdC);
MEGART_ABI(ncclUniqueId*, NcclUniqueIdC*);
MEGART_ABI(ncclConfig_t*, NcclConfig2_14*);
template <typename R, typename... A>
struct Abi<R (*)(A...)> {
  using type = abi_t<R> (*)(abi_t<A>...);
};

#define MEGART_SAME_ABI(member, function)                                              \
  static_assert(std::is_same_v<decltype(NcclApi::member), abi_t<decltype(&function)>>, \
                "NcclApi::" #member " does not match " #function " in nccl.h")

MEGART_SAME_ABI(get_unique_id, ncclGetUniqueId);
MEGART_SAME_ABI(comm_init_rank, ncclCommInitRank);
MEGART_SAME_ABI(comm_init_rank_config, ncclCommInitRankConfig);
MEGART_SAME_ABI(comm_finalize, ncclCommFinalize);
MEGART_SAME_ABI(comm_split, ncclCommSplit);
MEGART_SAME_ABI(comm_destroy, ncclCommDestroy);
MEGART_SAME_ABI(comm_abort, ncclCommAbort);
MEGART_SAME_ABI(comm_get_async_error, ncclCommGetAsyncError);
MEGART_SAME_ABI(get_error_string, ncclGetErrorString);
MEGART_SAME_ABI(get_last_error, ncclGetLastError);
MEGART_SAME_ABI(all_reduce, ncclAllReduce);
MEGART_SAME_ABI(all_gather, ncclAllGather);
MEGART_SAME_ABI(reduce_scatter, ncclReduceScatter);
MEGART_SAME_ABI(broadcast, ncclBroadcast);
MEGART_SAME_ABI(send, ncclSend);
MEGART_SAME_ABI(recv, ncclRecv);
MEGART_SAME_ABI(group_start, ncclGroupStart);
MEGART_SAME_ABI(group_end, ncclGroupEnd);
// cpp/comm/nccl_library.cpp calls ncclGetVersion as int (*)(int*).
static_assert(std::is_same_v<abi_t<decltype(&ncclGetVersion)>, int (*)(int*)>, "ncclGetVersion");

// Enums travel as int.
static_assert(sizeof(ncclResult_t) == sizeof(int) && sizeof(ncclDataType_t) == sizeof(int) &&
                  sizeof(ncclRedOp_t) == sizeof(int),
              "NCCL's enums are int-sized");
static_assert(kNcclSuccess == ncclSuccess && kNcclInProgress == ncclInProgress, "results");
static_assert(kNcclUint8 == ncclUint8 && kNcclInt32 == ncclInt32 && kNcclInt64 == ncclInt64 &&
                  kNcclFloat16 == ncclFloat16 && kNcclFloat32 == ncclFloat32 &&
                  kNcclFloat64 == ncclFloat64 && kNcclBfloat16 == ncclBfloat16,
              "data types");
static_assert(kNcclSum == ncclSum && kNcclMax == ncclMax && kNcclMin == ncclMin &&
                  kNcclAvg == ncclAvg,
              "reductions");
static_assert(kNccl2_10 == NCCL_VERSION(2, 10, 0) && kNccl2_14 == NCCL_VERSION(2, 14, 0) &&
                  kNccl2_18 == NCCL_VERSION(2, 18, 0),
              "version codes");

// The unique id and the config.
static_assert(kNcclUniqueIdBytes == NCCL_UNIQUE_ID_BYTES &&
                  sizeof(NcclUniqueIdC) == sizeof(ncclUniqueId) &&
                  alignof(NcclUniqueIdC) == alignof(ncclUniqueId),
              "ncclUniqueId");
static_assert(offsetof(NcclConfig2_14, size) == offsetof(ncclConfig_t, size) &&
                  offsetof(NcclConfig2_14, magic) == offsetof(ncclConfig_t, magic) &&
                  offsetof(NcclConfig2_14, version) == offsetof(ncclConfig_t, version) &&
                  offsetof(NcclConfig2_14, blocking) == offsetof(ncclConfig_t, blocking) &&
                  sizeof(NcclConfig2_14) <= sizeof(ncclConfig_t),
              "megart's config is the start of ncclConfig_t");
constexpr ncclConfig_t kNcclDefaults = NCCL_CONFIG_INITIALIZER;
constexpr NcclConfig2_14 kMegartDefaults{};
static_assert(kMegartDefaults.magic == kNcclDefaults.magic, "NCCL_CONFIG_INITIALIZER's magic");
static_assert(kMegartDefaults.blocking == kNcclDefaults.blocking &&
                  kMegartDefaults.blocking == NCCL_CONFIG_UNDEF_INT,
              "an undefined attribute is NCCL_CONFIG_UNDEF_INT");
static_assert(kMegartDefaults.size == sizeof(NcclConfig2_14) &&
                  kMegartDefaults.version == NCCL_VERSION(2, 14, 0),
              "megart's config says it follows NCCL 2.14's struct");

}  // namespace
}  // namespace megart::cuda
