#include "comm/nccl_library.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <thread>

#include "common/error.hpp"

namespace megart::comm {

namespace {
using GetVersionFn = int (*)(int*);  // ncclResult_t ncclGetVersion(int*)
}  // namespace

NcclLibrary NcclLibrary::load(const std::vector<std::string>& candidates) {
  std::string tried;
  for (const std::string& path : candidates) {
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* why = dlerror();
      tried += "\n  " + path + ": " + (why ? why : "cannot be opened");
      continue;
    }
    if (dlsym(handle, "ncclGetVersion") == nullptr) {
      tried += "\n  " + path + ": loads, but has no ncclGetVersion";
      continue;
    }
    return NcclLibrary(handle, path);
  }
  throw Error(
      "NCCL was not found. Install it with `pip install megart[cuda]` (nvidia-nccl-cu12) or set "
      "MEGART_NCCL_LIBRARY to the path of libnccl.so.2. Looked in:" +
      (tried.empty() ? std::string("\n  (no candidates)") : tried));
}

void* NcclLibrary::symbol(const char* name) const {
  void* fn = dlsym(handle_, name);
  if (fn == nullptr) {
    throw Error(std::string("NCCL at ") + path_ + " has no function " + name +
                "; it may be too old for megart");
  }
  return fn;
}

int NcclLibrary::version_code() const {
  int code = 0;
  const int result = reinterpret_cast<GetVersionFn>(symbol("ncclGetVersion"))(&code);
  if (result != 0) {
    throw Error("ncclGetVersion failed with NCCL result " + std::to_string(result) + " (" + path_ +
                ")");
  }
  return code;
}

std::string NcclLibrary::version() const { return nccl_version_string(version_code()); }

int wait_nccl_state(int state, const std::function<int(int*)>& poll,
                    std::chrono::steady_clock::time_point deadline) {
  auto pause = std::chrono::microseconds(10);
  while (state == kNcclInProgress) {
    if (std::chrono::steady_clock::now() > deadline) return kNcclInProgress;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
    int polled_state = kNcclInProgress;
    const int polled = poll(&polled_state);
    state = polled != kNcclSuccess ? polled : polled_state;
  }
  return state;
}

std::string nccl_version_string(int code) {
  const bool new_scheme = code >= 20900;
  const int major = new_scheme ? code / 10000 : code / 1000;
  const int minor = new_scheme ? code % 10000 / 100 : code % 1000 / 100;
  const int patch = code % 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

}  // namespace megart::comm
