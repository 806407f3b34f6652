// NCCL, loaded at run time so that megart installs and imports on machines without it.
#pragma once

#include <string>
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

// Splits NCCL's version code: 2.9 and later encode major*10000 + minor*100 + patch, older ones
// major*1000 + minor*100 + patch.
std::string nccl_version_string(int code);

}  // namespace megart::comm
