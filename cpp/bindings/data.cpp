#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "bindings.hpp"
#include "data/blending.hpp"

namespace py = pybind11;

namespace megart::bindings {

void bind_data(py::module_& m) {
  m.def(
      "blending_indices",
      [](const std::vector<double>& weights, int64_t size) {
        // Written in place into the arrays returned (a blend of a long run has ~1e9 samples).
        py::array_t<int16_t> which(size < 0 ? 0 : size);
        py::array_t<int64_t> nth(size < 0 ? 0 : size);
        int16_t* w = which.mutable_data();
        int64_t* n = nth.mutable_data();
        {
          py::gil_scoped_release release;
          data::blending_indices(weights, size, w, n);
        }
        return std::make_pair(which, nth);
      },
      py::arg("weights"), py::arg("size"),
      "For each of `size` samples of a blend, the dataset it comes from (int16) and that "
      "dataset's sample number (int64): Megatron-Core's greedy rule (the dataset whose weight "
      "times max(i, 1) exceeds its count so far the most, the first on ties).");
}

}  // namespace megart::bindings
