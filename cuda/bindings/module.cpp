// The `_cuda` module: CUDA kernels on raw device pointers and stream handles. It links the CUDA
// runtime statically, which loads the driver only on first use, so importing it on a machine
// without a GPU or driver succeeds and device_count() answers 0.
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "kernels/multi_tensor_scale.cuh"

namespace py = pybind11;

namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw megart::Error(std::string(what) + " failed: " + cudaGetErrorName(err) + " (" +
                        cudaGetErrorString(err) + ")");
  }
}

template <typename T>
std::vector<T> as_pointers(const std::vector<std::uintptr_t>& addresses) {
  std::vector<T> out;
  out.reserve(addresses.size());
  for (auto a : addresses) out.push_back(reinterpret_cast<T>(a));
  return out;
}

}  // namespace

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "megart's CUDA kernels (raw device pointers, stream handles)";
  m.def("toolkit_version", [] {
    return std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10);
  });
  m.def("device_count", [] {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      cudaGetLastError();  // clear the sticky "no driver" / "no device" error
      return 0;
    }
    return count;
  });
  m.def(
      "multi_tensor_scale",
      [](const std::vector<std::uintptr_t>& in, const std::vector<std::uintptr_t>& out,
         const std::vector<int64_t>& sizes, float scale, std::uintptr_t found_nonfinite,
         std::uintptr_t stream) {
        if (in.size() != out.size() || in.size() != sizes.size()) {
          throw megart::ConfigError("multi_tensor_scale needs as many outputs and sizes as inputs");
        }
        const auto src = as_pointers<const float*>(in);
        const auto dst = as_pointers<float*>(out);
        py::gil_scoped_release release;
        check(megart::cuda::multi_tensor_scale(
                  src.data(), dst.data(), sizes.data(), static_cast<int>(in.size()), scale,
                  reinterpret_cast<int*>(found_nonfinite), reinterpret_cast<cudaStream_t>(stream)),
              "multi_tensor_scale");
      },
      py::arg("inputs"), py::arg("outputs"), py::arg("sizes"), py::arg("scale"),
      py::arg("found_nonfinite"), py::arg("stream"),
      "out[i] = in[i] * scale for float32 device tensors given by address; sets the int32 at "
      "found_nonfinite to 1 if any input is inf or NaN.");
}
