// Element types and reductions that the communicators move and combine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace megart::comm {

enum class DType : std::uint8_t { Float32, Float16, BFloat16, Float64, Int32, Int64, UInt8 };
enum class ReduceOp : std::uint8_t { Sum, Avg, Max, Min };

std::size_t dtype_size(DType t);
const char* dtype_name(DType t);  // torch's names: "float32", "bfloat16", ...
DType dtype_from_name(const std::string& name);
const char* reduce_op_name(ReduceOp op);
ReduceOp reduce_op_from_name(const std::string& name);

// A contiguous host or device buffer: the core never sees a torch tensor.
struct Buffer {
  void* data = nullptr;
  std::size_t count = 0;  // elements
  DType dtype = DType::Float32;
  std::size_t bytes() const { return count * dtype_size(dtype); }
};

// For all_gather and reduce_scatter: "" when `whole` holds `size` x `part` elements of the
// part's dtype, else what is wrong, e.g. "the output must hold size x input = 8 elements of the
// input's dtype, not 6". Every transport checks this before it moves anything.
std::string split_mismatch(const Buffer& whole, const Buffer& part, int size,
                           const char* whole_name, const char* part_name);

// out[i] = op(srcs[0][i], ..., srcs[n-1][i]) for i < count, combining in source order so every
// rank that reduces the same sources gets bit-identical results. 16-bit floats are combined in
// float32 and rounded once. `out` may alias any source.
void reduce(void* out, const void* const* srcs, int n, std::size_t count, DType t, ReduceOp op);

}  // namespace megart::comm
