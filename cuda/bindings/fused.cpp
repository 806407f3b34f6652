// The fused kernels in `_cuda`: device buffers by address, the element type by name, and the
// caller's CUDA stream as an integer handle (torch.cuda.current_stream().cuda_stream). The
// Python wrappers in megart.kernels check shapes and make tensors contiguous; these checks
// catch what would otherwise be an out-of-bounds launch.
//
// Ran on one H200 (2026-11-26): see kernels/fused_ops.cuh.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "comm/cuda_util.hpp"
#include "common/error.hpp"
#include "kernels/fused_ops.cuh"

namespace py = pybind11;

namespace megart::cuda {

namespace {

using Address = std::uintptr_t;

FusedType fused_type(const std::string& name, const char* op) {
  if (name == "float32") return FusedType::kFloat32;
  if (name == "bfloat16") return FusedType::kBFloat16;
  if (name == "float16") return FusedType::kFloat16;
  throw ConfigError(std::string(op) + ": unsupported dtype '" + name +
                    "'; use float32, bfloat16 or float16");
}

void require(bool ok, const char* op, const std::string& what) {
  if (!ok) throw ConfigError(std::string(op) + ": " + what);
}

// Rows and columns of an [rows, columns] launch: non-negative rows (at most 2^31 - 1, one block
// each) and at least one column.
void check_rows(int64_t rows, int64_t columns, const char* op) {
  require(rows >= 0 && rows < (int64_t{1} << 31), op,
          "the row count must be in [0, 2^31); split the batch");
  require(columns > 0, op, "the last dimension must not be empty");
}

void launched(cudaError_t err, const char* op) {
  if (err != cudaSuccess) throw Error(std::string(op) + " failed: " + cuda_text(err));
}

template <typename T>
T* ptr(Address a) {
  return reinterpret_cast<T*>(a);
}

cudaStream_t as_stream(Address s) { return reinterpret_cast<cudaStream_t>(s); }

}  // namespace

void bind_fused(py::module_& m) {
  m.def(
      "bias_gelu_forward",
      [](Address x, Address bias, Address out, int64_t n, int64_t hidden, const std::string& dtype,
         Address stream) {
        const char* op = "bias_gelu_forward";
        const FusedType type = fused_type(dtype, op);
        require(hidden > 0 && n >= 0 && n % hidden == 0, op,
                "the element count must be a multiple of the bias size");
        py::gil_scoped_release release;
        launched(bias_gelu_forward(ptr<const void>(x), ptr<const void>(bias), ptr<void>(out), n,
                                   hidden, type, as_stream(stream)),
                 op);
      },
      py::arg("x"), py::arg("bias"), py::arg("out"), py::arg("n"), py::arg("hidden"),
      py::arg("dtype"), py::arg("stream"),
      "out = gelu_tanh(x + bias) over n elements, bias of `hidden`.");
  m.def(
      "bias_gelu_backward",
      [](Address grad, Address x, Address bias, Address grad_x, int64_t n, int64_t hidden,
         const std::string& dtype, Address stream) {
        const char* op = "bias_gelu_backward";
        const FusedType type = fused_type(dtype, op);
        require(hidden > 0 && n >= 0 && n % hidden == 0, op,
                "the element count must be a multiple of the bias size");
        py::gil_scoped_release release;
        launched(
            bias_gelu_backward(ptr<const void>(grad), ptr<const void>(x), ptr<const void>(bias),
                               ptr<void>(grad_x), n, hidden, type, as_stream(stream)),
            op);
      },
      py::arg("grad"), py::arg("x"), py::arg("bias"), py::arg("grad_x"), py::arg("n"),
      py::arg("hidden"), py::arg("dtype"), py::arg("stream"),
      "grad_x = grad * gelu_tanh'(x + bias).");
  m.def(
      "add_layer_norm_forward",
      [](Address x, Address residual, Address weight, Address bias, Address out, Address sum,
         Address mean, Address rstd, int64_t rows, int64_t hidden, double eps,
         const std::string& dtype, Address stream) {
        const char* op = "add_layer_norm_forward";
        const FusedType type = fused_type(dtype, op);
        check_rows(rows, hidden, op);
        require((residual == 0) == (sum == 0), op, "pass both residual and sum, or neither");
        require(eps > 0.0, op, "eps must be positive");
        py::gil_scoped_release release;
        launched(
            add_layer_norm_forward(ptr<const void>(x), ptr<const void>(residual),
                                   ptr<const void>(weight), ptr<const void>(bias), ptr<void>(out),
                                   ptr<void>(sum), ptr<float>(mean), ptr<float>(rstd), rows, hidden,
                                   static_cast<float>(eps), type, as_stream(stream)),
            op);
      },
      py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("bias"), py::arg("out"),
      py::arg("sum"), py::arg("mean"), py::arg("rstd"), py::arg("rows"), py::arg("hidden"),
      py::arg("eps"), py::arg("dtype"), py::arg("stream"),
      "sum = x + residual; out = layer_norm(sum) per row; fp32 mean "
      "and rstd per row. residual/sum and bias may be 0.");
  m.def(
      "add_layer_norm_backward_blocks",
      [](int64_t rows, int64_t hidden, bool has_bias, const std::string& dtype) {
        const FusedType type = fused_type(dtype, "add_layer_norm_backward_blocks");
        return add_layer_norm_backward_blocks(rows, hidden, has_bias, type);
      },
      py::arg("rows"), py::arg("hidden"), py::arg("has_bias"), py::arg("dtype"),
      "Blocks add_layer_norm_backward uses on the current device (its fp32 workspace is "
      "blocks * hidden, twice that with a bias); 0 when `hidden` columns do not fit its shared "
      "memory.");
  m.def(
      "add_layer_norm_backward",
      [](Address grad_out, Address grad_sum, Address s, Address weight, Address mean, Address rstd,
         Address grad_in, Address grad_weight, Address grad_bias, Address workspace, int64_t rows,
         int64_t hidden, int blocks, const std::string& dtype, Address stream) {
        const char* op = "add_layer_norm_backward";
        const FusedType type = fused_type(dtype, op);
        check_rows(rows, hidden, op);
        require(blocks >= 1, op, "blocks comes from add_layer_norm_backward_blocks (>= 1)");
        py::gil_scoped_release release;
        launched(add_layer_norm_backward(
                     ptr<const void>(grad_out), ptr<const void>(grad_sum), ptr<const void>(s),
                     ptr<const void>(weight), ptr<const float>(mean), ptr<const float>(rstd),
                     ptr<void>(grad_in), ptr<void>(grad_weight), ptr<void>(grad_bias),
                     ptr<float>(workspace), rows, hidden, blocks, type, as_stream(stream)),
                 op);
      },
      py::arg("grad_out"), py::arg("grad_sum"), py::arg("s"), py::arg("weight"), py::arg("mean"),
      py::arg("rstd"), py::arg("grad_in"), py::arg("grad_weight"), py::arg("grad_bias"),
      py::arg("workspace"), py::arg("rows"), py::arg("hidden"), py::arg("blocks"), py::arg("dtype"),
      py::arg("stream"),
      "grad_in = d loss / d s (+ grad_sum when not 0); the weight (and bias, when not 0) "
      "gradients in the element type; workspace: fp32 blocks * hidden (x2 with a bias).");
  m.def(
      "vocab_cross_entropy_forward",
      [](Address logits, Address target, Address row_max, Address sum_exp, Address target_logit,
         int64_t rows, int64_t vocab, int64_t start, const std::string& dtype, Address stream) {
        const char* op = "vocab_cross_entropy_forward";
        const FusedType type = fused_type(dtype, op);
        check_rows(rows, vocab, op);
        py::gil_scoped_release release;
        launched(vocab_cross_entropy_forward(ptr<const void>(logits), ptr<const int64_t>(target),
                                             ptr<float>(row_max), ptr<float>(sum_exp),
                                             ptr<float>(target_logit), rows, vocab, start, type,
                                             as_stream(stream)),
                 op);
      },
      py::arg("logits"), py::arg("target"), py::arg("row_max"), py::arg("sum_exp"),
      py::arg("target_logit"), py::arg("rows"), py::arg("vocab"), py::arg("start"),
      py::arg("dtype"), py::arg("stream"),
      "Per row of this rank's logits slice: max, sum of exp(logit - "
      "max), and the target's logit (0 when the target id is outside [start, start + vocab)).");
  m.def(
      "vocab_cross_entropy_backward",
      [](Address logits, Address target, Address max, Address sum_exp, Address grad_loss,
         int64_t rows, int64_t vocab, int64_t start, const std::string& dtype, Address stream) {
        const char* op = "vocab_cross_entropy_backward";
        const FusedType type = fused_type(dtype, op);
        check_rows(rows, vocab, op);
        py::gil_scoped_release release;
        launched(vocab_cross_entropy_backward(ptr<void>(logits), ptr<const int64_t>(target),
                                              ptr<const float>(max), ptr<const float>(sum_exp),
                                              ptr<const float>(grad_loss), rows, vocab, start, type,
                                              as_stream(stream)),
                 op);
      },
      py::arg("logits"), py::arg("target"), py::arg("max"), py::arg("sum_exp"),
      py::arg("grad_loss"), py::arg("rows"), py::arg("vocab"), py::arg("start"), py::arg("dtype"),
      py::arg("stream"),
      "Overwrites logits with (softmax - onehot(target)) * grad_loss "
      "from the all-reduced max and sum_exp, row by row.");
}

}  // namespace megart::cuda
