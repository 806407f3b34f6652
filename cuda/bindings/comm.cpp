// The nccl transport in `_cuda`. The communicator it returns is a
// megart._core.comm.Communicator: that class (and Work) are registered by `_core`, and pybind11
// finds them from this module because both are built in one CMake build with the same pybind11
// and compiler, so they share pybind11's internals (PYBIND11_INTERNALS_ID); `_cuda` imports
// `_core` first so the classes are registered before anything is returned.
//
// Ran on one H200 (2026-11-26) with one rank and with two ranks sharing the GPU; never
// between GPUs.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>

#include "comm/communicator.hpp"
#include "comm/nccl_api.hpp"
#include "comm/nccl_communicator.hpp"
#include "comm/nccl_library.hpp"
#include "common/error.hpp"

namespace py = pybind11;

namespace megart::cuda {

void bind_nccl(py::module_& m) {
  m.def(
      "nccl_unique_id",
      [](const std::string& library_path) {
        NcclUniqueId id;
        {
          py::gil_scoped_release release;
          id = nccl_unique_id(comm::NcclLibrary::load({library_path}));
        }
        return py::bytes(id.data(), id.size());
      },
      py::arg("library_path"),
      "A new NCCL unique id (128 bytes) from the NCCL at `library_path`; needs no GPU.");
  m.def(
      "nccl_features",
      [](const std::string& library_path) {
        const auto library = comm::NcclLibrary::load({library_path});
        const NcclApi api(library);  // throws Error naming a function the library lacks
        py::dict out;
        out["version"] = library.version();
        out["nonblocking"] = api.comm_init_rank_config != nullptr && api.comm_finalize != nullptr;
        out["last_error"] = api.get_last_error != nullptr;
        return out;
      },
      py::arg("library_path"),
      "Looks up every NCCL function megart calls in the NCCL at `library_path` (raising "
      "MegartError naming one it lacks) and says which optional ones it has: {'version', "
      "'nonblocking' (ncclCommInitRankConfig and ncclCommFinalize, NCCL 2.14+), 'last_error' "
      "(ncclGetLastError)}. Needs no GPU.");
  m.def(
      "create_nccl",
      [](const std::string& library_path, const py::bytes& unique_id, int rank, int size,
         int device, double timeout_s,
         const std::string& group_name) -> std::shared_ptr<comm::Communicator> {
        const std::string raw = unique_id;
        if (raw.size() != kNcclUniqueIdBytes) {
          throw ConfigError("create_nccl: the unique id must be " +
                            std::to_string(kNcclUniqueIdBytes) + " bytes, not " +
                            std::to_string(raw.size()));
        }
        if (!(timeout_s > 0)) throw ConfigError("create_nccl: timeout_s must be positive");
        NcclUniqueId id;
        std::copy(raw.begin(), raw.end(), id.begin());
        const auto timeout = std::chrono::milliseconds(static_cast<long long>(timeout_s * 1000));
        std::shared_ptr<NcclCommunicator> made;
        {
          py::gil_scoped_release release;  // creation waits for every rank
          made = NcclCommunicator::create(comm::NcclLibrary::load({library_path}), id, rank, size,
                                          device, timeout, group_name);
        }
        // Python's reference releases the GIL while the communicator shuts down (finalizing
        // waits up to the timeout), so other Python threads run meanwhile. The deleter may run
        // on a thread without the GIL (the watchdog's), which then has nothing to release.
        NcclCommunicator* owner = made.get();
        return std::shared_ptr<comm::Communicator>(owner, [made](comm::Communicator*) mutable {
          if (PyGILState_Check()) {
            py::gil_scoped_release release;
            made.reset();
          } else {
            made.reset();
          }
        });
      },
      py::arg("library_path"), py::arg("unique_id"), py::arg("rank"), py::arg("size"),
      py::arg("device"), py::arg("timeout_s"), py::arg("group_name"),
      "Joins an NCCL group on CUDA device `device`: collective "
      "over its ranks, which all pass the same unique id. Returns a "
      "megart._core.comm.Communicator whose ops take device addresses and the caller's stream.");
}

}  // namespace megart::cuda
