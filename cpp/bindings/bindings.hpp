// The `_core` module is assembled from one binder per part of the core.
#pragma once

#include <pybind11/pybind11.h>

namespace megart::bindings {

void bind_errors(pybind11::module_& m);
void bind_schedule(pybind11::module_& m);
void bind_comm(pybind11::module_& m);
void bind_p2p_batch(pybind11::module_& m);  // part of the comm submodule
void bind_optim(pybind11::module_& m);
void bind_data(pybind11::module_& m);

}  // namespace megart::bindings
