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
#include "kernels/multi_tensor_adam.cuh"
#include "kernels/multi_tensor_scale.cuh"

namespace py = pybind11;

namespace megart::cuda {
void bind_nccl(py::module_& m);   // bindings/comm.cpp
void bind_fused(py::module_& m);  // bindings/fused.cpp
}  // namespace megart::cuda

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

megart::cuda::ScaleType scale_type(const std::string& name) {
  if (name == "float32") return megart::cuda::ScaleType::kFloat32;
  if (name == "bfloat16") return megart::cuda::ScaleType::kBFloat16;
  if (name == "float16") return megart::cuda::ScaleType::kFloat16;
  throw megart::ConfigError("multi_tensor_scale: unsupported dtype '" + name +
                            "'; use float32, bfloat16 or float16");
}

megart::cuda::AdamModelType adam_model_type(const std::string& name) {
  if (name == "float32") return megart::cuda::AdamModelType::kFloat32;
  if (name == "bfloat16") return megart::cuda::AdamModelType::kBFloat16;
  if (name == "float16") return megart::cuda::AdamModelType::kFloat16;
  throw megart::ConfigError("multi_tensor_adam: unsupported model dtype '" + name +
                            "'; use float32, bfloat16 or float16");
}

void multi_tensor_adam(const std::vector<std::uintptr_t>& params,
                       const std::vector<std::uintptr_t>& model_params,
                       const std::vector<std::uintptr_t>& grads,
                       const std::vector<std::uintptr_t>& exp_avgs,
                       const std::vector<std::uintptr_t>& exp_avg_sqs,
                       const std::vector<std::uintptr_t>& steps, const std::vector<int64_t>& sizes,
                       const std::string& model_dtype, double lr, double beta1, double beta2,
                       double eps, double weight_decay, bool decoupled_weight_decay,
                       std::uintptr_t found_inf, std::uintptr_t stream) {
  const auto type = adam_model_type(model_dtype);
  const size_t n = sizes.size();
  const bool low_precision = type != megart::cuda::AdamModelType::kFloat32;
  if (params.size() != n || grads.size() != n || exp_avgs.size() != n || exp_avg_sqs.size() != n ||
      steps.size() != n || (low_precision && model_params.size() != n)) {
    throw megart::ConfigError(
        "multi_tensor_adam needs one params, grads, exp_avgs, exp_avg_sqs, steps (and, for 16-bit "
        "dtypes, model_params) entry per size");
  }
  if (!(lr >= 0.0 && eps >= 0.0 && weight_decay >= 0.0 && beta1 >= 0.0 && beta1 < 1.0 &&
        beta2 >= 0.0 && beta2 < 1.0)) {
    throw megart::ConfigError(
        "multi_tensor_adam needs lr, eps, weight_decay >= 0 and 0 <= betas < 1");
  }
  const auto p = as_pointers<float*>(params);
  const auto mp = as_pointers<void*>(model_params);
  const auto g = as_pointers<const void*>(grads);
  const auto m = as_pointers<float*>(exp_avgs);
  const auto v = as_pointers<float*>(exp_avg_sqs);
  const auto s = as_pointers<float*>(steps);
  const megart::cuda::AdamHyper hyper{lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay};
  py::gil_scoped_release release;
  check(megart::cuda::multi_tensor_adam(
            p.data(), low_precision ? mp.data() : nullptr, g.data(), m.data(), v.data(), s.data(),
            sizes.data(), static_cast<int>(n), type, hyper, reinterpret_cast<const int*>(found_inf),
            reinterpret_cast<cudaStream_t>(stream)),
        "multi_tensor_adam");
}

}  // namespace

PYBIND11_MODULE(_cuda, m) {
  // `_core` registers the Communicator and Work classes and the error types that this module
  // returns and raises; pybind11 shares them across the two modules (same internals).
  py::module_::import("megart._core");
  m.doc() = "megart's CUDA kernels and nccl transport (raw device pointers, stream handles)";
  megart::cuda::bind_nccl(m);
  megart::cuda::bind_fused(m);
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
         const std::vector<int64_t>& sizes, const std::string& dtype, float scale,
         std::uintptr_t found_nonfinite, std::uintptr_t stream) {
        const megart::cuda::ScaleType type = scale_type(dtype);
        if (in.size() != out.size() || in.size() != sizes.size()) {
          throw megart::ConfigError("multi_tensor_scale needs as many outputs and sizes as inputs");
        }
        // The kernel writes the flag whenever it sees inf or NaN: a null one would fault there.
        if (found_nonfinite == 0) {
          throw megart::ConfigError(
              "multi_tensor_scale needs a found_nonfinite flag: the address of a zeroed int32 "
              "on the device");
        }
        const auto src = as_pointers<const void*>(in);
        const auto dst = as_pointers<void*>(out);
        py::gil_scoped_release release;
        check(megart::cuda::multi_tensor_scale(
                  src.data(), dst.data(), sizes.data(), static_cast<int>(in.size()), type, scale,
                  reinterpret_cast<int*>(found_nonfinite), reinterpret_cast<cudaStream_t>(stream)),
              "multi_tensor_scale");
      },
      py::arg("inputs"), py::arg("outputs"), py::arg("sizes"), py::arg("dtype"), py::arg("scale"),
      py::arg("found_nonfinite"), py::arg("stream"),
      "out[i] = in[i] * scale for float32, bfloat16 or float16 device tensors (all of `dtype`) "
      "given by address; sets the int32 at found_nonfinite to 1 if any input is inf or NaN.");
  m.def("multi_tensor_adam", &multi_tensor_adam, py::arg("params"), py::arg("model_params"),
        py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("steps"),
        py::arg("sizes"), py::arg("model_dtype"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
        py::arg("eps"), py::arg("weight_decay"), py::arg("decoupled_weight_decay"),
        py::arg("found_inf"), py::arg("stream"),
        "One Adam/AdamW step over device tensors given by address, on "
        "`stream`: fp32 params (main weights for 16-bit model_params), grads in model_dtype, fp32 "
        "moments, float32 step tensors advanced on the device. Skips everything when the int32 "
        "at found_inf (0 for none) is nonzero when the kernels run.");
}
