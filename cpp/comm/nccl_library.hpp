// NCCL, loaded at run time so that megart installs and imports on machines without it.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace megart::comm {

class NcclLibrary {
 public:
  // Opens the first candidate that loads and exports NCCL's API. Throws Error listing every
  // place it looked, and why each failed, when none does.
  static NcclLibrary load(const std::vector<std::string>& candidates);

  const std::string& path() const { return path_; }
  // ncclGetVersion's code, e.g. 23203 for 2.32.3.
  int version_code() const;
  // "2.32.3"
  std::string version() const;
  // The address of an NCCL function; throws Error naming it when the library lacks it.
  void* symbol(const char* name) const;

 private:
  NcclLibrary(void* handle, std::string path) : handle_(handle), path_(std::move(path)) {}
  // Never closed: NCCL starts threads that must not outlive its code, so it stays loaded for
  // the life of the process, as torch's copy does.
  void* handle_;
  std::string path_;
};

// The two ncclResult_t values megart tells apart from errors (nccl.h: ncclSuccess = 0,
// ncclInProgress = 7; ncclInProgress since NCCL 2.14, with non-blocking communicators).
constexpr int kNcclSuccess = 0;
constexpr int kNcclInProgress = 7;

// Waits out ncclInProgress on a non-blocking communicator. NCCL's rule: after a call on such a
// communicator answers ncclInProgress, ask ncclCommGetAsyncError (`poll`, which writes the state
// and returns its own result) until the state is no longer ncclInProgress, before the next call
// on it or on the streams it enqueues to. Starts from `state` (the call's answer), sleeps between
// polls (from 10 us, doubling up to 1 ms), and returns the first state that is not
// ncclInProgress: ncclSuccess, or the error (also a failed poll's own result). Returns
// ncclInProgress only when `deadline` passed first. Host-only, so it is unit-tested without NCCL.
int wait_nccl_state(int state, const std::function<int(int*)>& poll,
                    std::chrono::steady_clock::time_point deadline);

// Splits NCCL's version code: 2.9 and later encode major*10000 + minor*100 + patch, older ones
// major*1000 + minor*100 + patch.
std::string nccl_version_string(int code);

}  // namespace megart::comm
