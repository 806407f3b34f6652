// `_core.optim`: the CPU optimizer sweeps on raw host addresses. The Python layer turns torch
// tensors into (address, element count, dtype) and keeps them alive for the call.
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "bindings.hpp"
#include "common/error.hpp"
#include "optim/adam.hpp"
#include "optim/multi_tensor.hpp"
#include "optim/parallel.hpp"

namespace py = pybind11;

namespace megart::bindings {

namespace {

using Addresses = std::vector<std::uintptr_t>;

template <typename T>
T* pointer(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

void check_length(const Addresses& list, size_t n, const char* what) {
  if (list.size() != n) {
    throw ConfigError(std::string(what) + " has " + std::to_string(list.size()) +
                      " entries, expected one per tensor (" + std::to_string(n) + ")");
  }
}

std::vector<optim::TensorRef> refs(const Addresses& data, const std::vector<int64_t>& sizes,
                                   const char* what) {
  check_length(data, sizes.size(), what);
  std::vector<optim::TensorRef> out(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) out[i] = {pointer<void>(data[i]), sizes[i]};
  return out;
}

void adam_step(const Addresses& params, const Addresses& model_params, const Addresses& grads,
               const Addresses& exp_avgs, const Addresses& exp_avg_sqs, const Addresses& steps,
               const std::vector<int64_t>& sizes, const std::string& model_dtype, double lr,
               double beta1, double beta2, double eps, double weight_decay,
               bool decoupled_weight_decay, bool amsgrad, int num_threads) {
  const size_t n = sizes.size();
  const optim::DType dtype = optim::dtype_from_name(model_dtype);
  check_length(params, n, "params");
  if (dtype != optim::DType::kFloat32) check_length(model_params, n, "model_params");
  check_length(grads, n, "grads");
  check_length(exp_avgs, n, "exp_avgs");
  check_length(exp_avg_sqs, n, "exp_avg_sqs");
  check_length(steps, n, "steps");
  std::vector<optim::AdamTensor> tensors(n);
  for (size_t i = 0; i < n; ++i) {
    tensors[i] = {pointer<float>(params[i]),
                  dtype == optim::DType::kFloat32 ? nullptr : pointer<void>(model_params[i]),
                  pointer<const void>(grads[i]),
                  pointer<float>(exp_avgs[i]),
                  pointer<float>(exp_avg_sqs[i]),
                  pointer<float>(steps[i]),
                  sizes[i]};
  }
  optim::AdamOptions options;
  options.lr = lr;
  options.beta1 = beta1;
  options.beta2 = beta2;
  options.eps = eps;
  options.weight_decay = weight_decay;
  options.decoupled_weight_decay = decoupled_weight_decay;
  options.amsgrad = amsgrad;
  py::gil_scoped_release release;
  optim::adam_step(tensors, dtype, options, num_threads);
}

}  // namespace

void bind_optim(py::module_& m) {
  m.def("adam_step", &adam_step, py::arg("params"), py::arg("model_params"), py::arg("grads"),
        py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("steps"), py::arg("sizes"),
        py::arg("model_dtype"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("decoupled_weight_decay"), py::arg("amsgrad") = false,
        py::arg("num_threads") = 0,
        "One Adam/AdamW step over many contiguous CPU tensors given by address: fp32 params (or "
        "fp32 main weights), grads and model_params in model_dtype (model_params empty for "
        "float32), fp32 moments, and torch's float32 step tensors, which it increments.");
  m.def(
      "sum_of_squares",
      [](const Addresses& data, const std::vector<int64_t>& sizes, const std::string& dtype,
         int num_threads) {
        const auto tensors = refs(data, sizes, "tensors");
        const auto d = optim::dtype_from_name(dtype);
        py::gil_scoped_release release;
        return optim::sum_of_squares(tensors, d, num_threads);
      },
      py::arg("tensors"), py::arg("sizes"), py::arg("dtype"), py::arg("num_threads") = 0,
      "Sum of squares of all elements of contiguous CPU tensors, accumulated in double.");
  m.def(
      "scale",
      [](const Addresses& in, const Addresses& out, const std::vector<int64_t>& sizes,
         const std::string& dtype, float factor, int num_threads) {
        const auto src = refs(in, sizes, "inputs");
        const auto dst = refs(out, sizes, "outputs");
        const auto d = optim::dtype_from_name(dtype);
        py::gil_scoped_release release;
        return optim::scale(src, dst, d, factor, num_threads);
      },
      py::arg("inputs"), py::arg("outputs"), py::arg("sizes"), py::arg("dtype"), py::arg("scale"),
      py::arg("num_threads") = 0,
      "out = in * scale over contiguous CPU tensors (outputs may be the inputs); returns True "
      "when any input element is inf or NaN.");
  m.def("resolve_threads", &optim::resolve_threads, py::arg("requested") = 0,
        "Threads a sweep uses: the request if positive, else MEGART_NUM_THREADS, else the CPUs "
        "this process may run on.");
}

}  // namespace megart::bindings
