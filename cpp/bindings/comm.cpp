#include <pybind11/stl.h>

#include "bindings.hpp"
#include "comm/nccl_library.hpp"

namespace py = pybind11;

namespace megart::bindings {

void bind_comm(py::module_& m) {
  m.def(
      "load_nccl",
      [](const std::vector<std::string>& candidates) {
        const auto lib = comm::NcclLibrary::load(candidates);
        return py::make_tuple(lib.path(), lib.version());
      },
      py::arg("candidates"),
      "Opens the first of `candidates` that is NCCL; returns (path, version). Raises MegartError "
      "listing every place it looked when none is.");
  m.def("nccl_version_string", &comm::nccl_version_string, py::arg("code"));
}

}  // namespace megart::bindings
