#include "bindings.hpp"
#include "common/error.hpp"

namespace py = pybind11;

namespace megart::bindings {

void bind_errors(py::module_& m) {
  // Registered base first: pybind11 tries the newest translator first, so a derived error is
  // raised as its own type.
  auto base = py::register_exception<Error>(m, "MegartError", PyExc_RuntimeError);
  py::register_exception<ConfigError>(m, "ConfigError",
                                      py::make_tuple(base, py::handle(PyExc_ValueError)));
  auto schedule = py::register_exception<ScheduleError>(m, "ScheduleError", base);
  py::register_exception<DeadlockError>(m, "DeadlockError", schedule);
  auto comm = py::register_exception<CommError>(m, "CommError", base);
  py::register_exception<CommTimeoutError>(m, "CommTimeoutError",
                                           py::make_tuple(comm, py::handle(PyExc_TimeoutError)));
}

}  // namespace megart::bindings

PYBIND11_MODULE(_core, m) {
  m.doc() =
      "megart's C++ core: pipeline schedules, communication, optimizers and dataset order (no "
      "torch, no CUDA)";
  m.attr("__version__") = MEGART_VERSION;
  megart::bindings::bind_errors(m);
  auto schedule = m.def_submodule("schedule", "pipeline schedules: build, validate, simulate");
  megart::bindings::bind_schedule(schedule);
  auto comm = m.def_submodule("comm", "communication: NCCL loading, transports");
  megart::bindings::bind_comm(comm);
  auto optim = m.def_submodule("optim", "optimizers: multi-tensor Adam, norms, scaling (CPU)");
  megart::bindings::bind_optim(optim);
  auto data = m.def_submodule("data", "datasets: Megatron-Core's blending order");
  megart::bindings::bind_data(data);
}
