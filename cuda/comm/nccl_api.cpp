// Ran on one GPU only (see nccl_communicator.hpp).
#include "comm/nccl_api.hpp"

#include <cstring>
#include <type_traits>

#include "common/error.hpp"

namespace megart::cuda {

NcclApi::NcclApi(const comm::NcclLibrary& lib) {
  auto get = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(lib.symbol(name));
  };
  get(get_unique_id, "ncclGetUniqueId");
  get(comm_init_rank, "ncclCommInitRank");
  get(comm_destroy, "ncclCommDestroy");
  get(comm_abort, "ncclCommAbort");
  get(comm_get_async_error, "ncclCommGetAsyncError");
  get(get_error_string, "ncclGetErrorString");
  get(all_reduce, "ncclAllReduce");
  get(all_gather, "ncclAllGather");
  get(reduce_scatter, "ncclReduceScatter");
  get(broadcast, "ncclBroadcast");
  get(send, "ncclSend");
  get(recv, "ncclRecv");
  get(group_start, "ncclGroupStart");
  get(group_end, "ncclGroupEnd");
  try {
    get(get_last_error, "ncclGetLastError");
  } catch (const Error&) {
    get_last_error = nullptr;
  }
  if (lib.version_code() >= kNccl2_14) {
    // Both or neither: a non-blocking communicator is shut down with ncclCommFinalize.
    try {
      get(comm_init_rank_config, "ncclCommInitRankConfig");
      get(comm_finalize, "ncclCommFinalize");
    } catch (const Error&) {
      comm_init_rank_config = nullptr;  // the blocking ncclCommInitRank then
      comm_finalize = nullptr;
    }
  }
  if (comm_init_rank_config != nullptr && lib.version_code() >= kNccl2_18) {
    try {
      get(comm_split, "ncclCommSplit");
    } catch (const Error&) {
      comm_split = nullptr;  // ops then run on the non-blocking communicator
    }
  }
}

std::string NcclApi::explain(NcclResult result, void* comm) const {
  std::string text = "NCCL result " + std::to_string(result);
  if (get_error_string != nullptr) {
    const char* s = get_error_string(result);
    if (s != nullptr) text += " (" + std::string(s) + ")";
  }
  if (get_last_error != nullptr) {
    const char* last = get_last_error(comm);
    if (last != nullptr && last[0] != '\0') text += "; NCCL's last error: " + std::string(last);
  }
  return text;
}

NcclUniqueId nccl_unique_id(const comm::NcclLibrary& library) {
  auto fn = reinterpret_cast<NcclResult (*)(NcclUniqueIdC*)>(library.symbol("ncclGetUniqueId"));
  NcclUniqueIdC id{};
  const NcclResult result = fn(&id);
  if (result != kNcclSuccess) {
    NcclApi api(library);
    throw CommError("ncclGetUniqueId failed with " + api.explain(result, nullptr) + " (NCCL at " +
                    library.path() + ")");
  }
  NcclUniqueId out;
  std::memcpy(out.data(), id.internal, kNcclUniqueIdBytes);
  return out;
}

}  // namespace megart::cuda
