// Ran on one H200 (2026-11-26). See fused_ops.cuh.
//
// LayerNorm with the residual add folded in: one block per row reads x and residual once, writes
// their sum (the next residual) and the normalised row, and keeps mean and rstd for the backward.
// The statistics use two passes over the row (mean, then squared deviations), re-reading the row
// from cache: no cancellation even when a few channels are far larger than the rest (as in
// large models' residual streams), which one-pass sums of v and v^2 would suffer.
#include <initializer_list>
#include <map>
#include <mutex>
#include <tuple>

#include "fused_device.cuh"

namespace megart::cuda {

namespace {

using fused::block_sum;
using fused::for_each_in_row;
using fused::load;
using fused::store;
using fused::to_float;

template <typename T>
__global__ void add_layer_norm_forward_kernel(const T* x, const T* residual, const T* weight,
                                              const T* bias, T* out, T* sum, float* mean_out,
                                              float* rstd_out, int64_t hidden, float eps,
                                              bool vectorise) {
  __shared__ float scratch[32];
  const int64_t offset = static_cast<int64_t>(blockIdx.x) * hidden;
  const T* x_row = x + offset;
  // The normalised input: the sum when there is a residual, else x itself.
  const T* s_row = residual != nullptr ? sum + offset : x_row;

  float acc = 0.0f;
  for_each_in_row(x_row, hidden, vectorise, [&](int64_t j, auto width) {
    constexpr int W = decltype(width)::value;
    float v[W];
    load<W>(x_row + j, v);
    if (residual != nullptr) {
      float r[W];
      load<W>(residual + offset + j, r);
#pragma unroll
      for (int k = 0; k < W; ++k) v[k] += r[k];
      store<W>(sum + offset + j, v);
      // Normalise the sum as stored (rounded to T), as the unfused add then LayerNorm does.
#pragma unroll
      for (int k = 0; k < W; ++k) v[k] = to_float(fused::from_float<T>(v[k]));
    }
#pragma unroll
    for (int k = 0; k < W; ++k) acc += v[k];
  });
  // block_sum's barriers also make the sum written above visible to the whole block.
  const float mean = block_sum(acc, scratch) / static_cast<float>(hidden);

  acc = 0.0f;
  for_each_in_row(s_row, hidden, vectorise, [&](int64_t j, auto width) {
    constexpr int W = decltype(width)::value;
    float v[W];
    load<W>(s_row + j, v);
#pragma unroll
    for (int k = 0; k < W; ++k) acc += (v[k] - mean) * (v[k] - mean);
  });
  const float rstd = math::layer_norm_rstd(block_sum(acc, scratch), hidden, eps);

  for_each_in_row(s_row, hidden, vectorise, [&](int64_t j, auto width) {
    constexpr int W = decltype(width)::value;
    float v[W];
    float w[W];
    load<W>(s_row + j, v);
    load<W>(weight + j, w);
    float b[W] = {};
    if (bias != nullptr) load<W>(bias + j, b);
#pragma unroll
    for (int k = 0; k < W; ++k) v[k] = math::layer_norm_output(v[k], mean, rstd, w[k], b[k]);
    store<W>(out + offset + j, v);
  });
  if (threadIdx.x == 0) {
    mean_out[blockIdx.x] = mean;
    rstd_out[blockIdx.x] = rstd;
  }
}

// Shared-memory slot of column j: one spare slot after every pack, so the threads of a warp,
// each adding to the W columns of its own pack, hit different banks (stride W + 1, odd).
template <typename T>
__device__ __forceinline__ int64_t slot(int64_t j) {
  return j + j / fused::kPack<T>;
}

// Each block takes rows blockIdx.x, + gridDim.x, ... and accumulates its share of the weight and
// bias gradients in shared memory (one slot per column); a column belongs to the same thread in
// every row, since all rows split alike. column_sum_kernel then sums the blocks' partial rows.
template <typename T>
__global__ void add_layer_norm_backward_kernel(const T* grad_out, const T* grad_sum, const T* s,
                                               const T* weight, const float* mean,
                                               const float* rstd, T* grad_in, float* partial_weight,
                                               float* partial_bias, int64_t rows, int64_t hidden,
                                               bool vectorise) {
  extern __shared__ float columns[];  // weight grads, then bias grads, at slot(column)
  __shared__ float scratch[32];
  const int64_t slots = slot<T>(hidden);
  float* dweight = columns;
  float* dbias = columns + slots;
  const bool has_bias = partial_bias != nullptr;
  for (int64_t j = threadIdx.x; j < (has_bias ? 2 : 1) * slots; j += blockDim.x) columns[j] = 0;
  __syncthreads();

  const float inv_hidden = 1.0f / static_cast<float>(hidden);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t offset = row * hidden;
    const float mu = mean[row];
    const float rs = rstd[row];
    // d loss / d s = rstd (g - mean(g) - xhat mean(g xhat)), g = grad_out * weight.
    math::LayerNormGradSums sums;
    for_each_in_row(s + offset, hidden, vectorise, [&](int64_t j, auto width) {
      constexpr int W = decltype(width)::value;
      float dy[W];
      float v[W];
      float w[W];
      load<W>(grad_out + offset + j, dy);
      load<W>(s + offset + j, v);
      load<W>(weight + j, w);
#pragma unroll
      for (int k = 0; k < W; ++k) {
        // This element's shares (0 + x is exact, so adding them after changes nothing).
        float dw = 0.0f;
        float db = 0.0f;
        math::layer_norm_grad_accumulate(dy[k], v[k], w[k], mu, rs, sums, dw, db);
        dweight[slot<T>(j + k)] += dw;
        if (has_bias) dbias[slot<T>(j + k)] += db;
      }
    });
    const float mean_g = block_sum(sums.g, scratch) * inv_hidden;
    const float mean_g_xhat = block_sum(sums.g_xhat, scratch) * inv_hidden;
    for_each_in_row(s + offset, hidden, vectorise, [&](int64_t j, auto width) {
      constexpr int W = decltype(width)::value;
      float dy[W];
      float v[W];
      float w[W];
      float extra[W] = {};
      load<W>(grad_out + offset + j, dy);
      load<W>(s + offset + j, v);
      load<W>(weight + j, w);
      if (grad_sum != nullptr) load<W>(grad_sum + offset + j, extra);
#pragma unroll
      for (int k = 0; k < W; ++k) {
        dy[k] =
            math::layer_norm_input_grad(dy[k], v[k], w[k], mu, rs, mean_g, mean_g_xhat, extra[k]);
      }
      store<W>(grad_in + offset + j, dy);
    });
  }
  __syncthreads();
  float* out_weight = partial_weight + static_cast<int64_t>(blockIdx.x) * hidden;
  for (int64_t j = threadIdx.x; j < hidden; j += blockDim.x) out_weight[j] = dweight[slot<T>(j)];
  if (has_bias) {
    float* out_bias = partial_bias + static_cast<int64_t>(blockIdx.x) * hidden;
    for (int64_t j = threadIdx.x; j < hidden; j += blockDim.x) out_bias[j] = dbias[slot<T>(j)];
  }
}

// Column sums of the backward's per-block partial gradients, rounded once to T: grad[j] =
// sum over b of partial[b][j] for the weight (blockIdx.y 0) and the bias (1, partial after the
// weight's [blocks, hidden]). A block takes kSumColumns adjacent columns, so each warp reads
// 128 contiguous bytes of a partial row; its kSumGroups rows of threads take every
// kSumGroups-th partial row and meet in shared memory. Done here rather than by torch's
// sum(0).to(dtype) after the launch: that was two reductions and two casts per backward, each
// an operator call on the host.
constexpr int kSumColumns = 32;
constexpr int kSumGroups = 8;

template <typename T>
__global__ void column_sum_kernel(const float* partial, T* grad_weight, T* grad_bias,
                                  int64_t blocks, int64_t hidden) {
  __shared__ float share[kSumGroups][kSumColumns + 1];  // +1: a spare bank per row
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kSumColumns + threadIdx.x;
  const float* rows = partial + static_cast<int64_t>(blockIdx.y) * blocks * hidden;
  float acc = 0.0f;
  if (j < hidden) {
    for (int64_t b = threadIdx.y; b < blocks; b += kSumGroups) acc += rows[b * hidden + j];
  }
  share[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y != 0 || j >= hidden) return;
  float total = 0.0f;
#pragma unroll
  for (int g = 0; g < kSumGroups; ++g) total += share[g][threadIdx.x];
  (blockIdx.y == 0 ? grad_weight : grad_bias)[j] = fused::from_float<T>(total);
}

// Packs are used when every array's rows are aligned alike: the same offset from 16 bytes for
// all base pointers, and rows a whole number of 16-byte units long (so every row starts at the
// same offset as weight and bias).
template <typename T>
bool aligned_alike(int64_t hidden, std::initializer_list<const void*> pointers) {
  if ((hidden * static_cast<int64_t>(sizeof(T))) % 16 != 0) return false;
  const int64_t m = fused::misalignment(*pointers.begin());
  for (const void* p : pointers) {
    if (p != nullptr && fused::misalignment(p) != m) return false;
  }
  return true;
}

// What the backward kernel may use on the current device: the dynamic shared memory a block may
// have (its opt-in limit, less the kernel's static scratch) and the SM count. Found, and the
// kernel's opt-in raised to that limit, once per device and element type (they were runtime
// calls made twice on every backward, for the block count and again for the launch). The opt-in is
// always the most a block may have, not one call's need: it is one attribute shared by every
// thread, and threads that set it to their own sizes could shrink it under another's launch.
struct BackwardLimits {
  size_t shared_bytes = 0;
  int sms = 0;
};

template <typename T>
cudaError_t backward_limits(BackwardLimits* limits) {
  static std::mutex mutex;
  static std::map<int, BackwardLimits> known;  // by device
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = known.find(device);
  if (found != known.end()) {
    *limits = found->second;
    return cudaSuccess;
  }
  int optin = 0;
  BackwardLimits fresh;
  cudaFuncAttributes attributes{};
  err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&fresh.sms, cudaDevAttrMultiProcessorCount, device);
  }
  if (err == cudaSuccess)
    err = cudaFuncGetAttributes(&attributes, add_layer_norm_backward_kernel<T>);
  if (err != cudaSuccess) return err;
  fresh.shared_bytes = static_cast<size_t>(optin) - attributes.sharedSizeBytes;
  err = cudaFuncSetAttribute(add_layer_norm_backward_kernel<T>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(fresh.shared_bytes));
  if (err != cudaSuccess) return err;
  known.emplace(device, fresh);
  *limits = fresh;
  return cudaSuccess;
}

// Dynamic shared memory of the backward kernel for `hidden` columns (its per-column
// accumulators); cudaErrorInvalidValue when that exceeds what a block may have on this device.
template <typename T>
cudaError_t backward_shared_bytes(int64_t hidden, bool has_bias, size_t* bytes,
                                  BackwardLimits* limits) {
  const int64_t slots = hidden + hidden / fused::kPack<T>;  // slot<T>(hidden), on the host
  *bytes = static_cast<size_t>(slots) * sizeof(float) * (has_bias ? 2 : 1);
  const cudaError_t err = backward_limits<T>(limits);
  if (err != cudaSuccess) return err;
  return *bytes > limits->shared_bytes ? cudaErrorInvalidValue : cudaSuccess;
}

// Blocks of the backward kernel resident on one SM for these columns, once per device, type and
// shape (the occupancy calculator is another runtime call).
template <typename T>
cudaError_t backward_blocks_per_sm(int64_t hidden, bool has_bias, int* per_sm, int* sms) {
  static std::mutex mutex;
  static std::map<std::tuple<int, int64_t, bool>, int> known;  // (device, hidden, has_bias)
  size_t bytes = 0;
  BackwardLimits limits;
  cudaError_t err = backward_shared_bytes<T>(hidden, has_bias, &bytes, &limits);
  int device = 0;
  if (err == cudaSuccess) err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  *sms = limits.sms;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(device, hidden, has_bias);
  const auto found = known.find(key);
  if (found != known.end()) {
    *per_sm = found->second;
    return cudaSuccess;
  }
  const int threads = fused::row_threads(hidden, fused::kPack<T>);
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(per_sm, add_layer_norm_backward_kernel<T>,
                                                      threads, bytes);
  if (err == cudaSuccess) known.emplace(key, *per_sm);
  return err;
}

}  // namespace

cudaError_t add_layer_norm_forward(const void* x, const void* residual, const void* weight,
                                   const void* bias, void* out, void* sum, float* mean, float* rstd,
                                   int64_t rows, int64_t hidden, float eps, FusedType type,
                                   cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (rows < 0 || rows > fused::kMaxRows || hidden <= 0 ||
      (residual != nullptr && sum == nullptr)) {
    return cudaErrorInvalidValue;
  }
  return fused::dispatch(type, [&](auto tag) {
    using T = decltype(tag);
    const bool vectorise = aligned_alike<T>(hidden, {x, residual, weight, bias, out, sum});
    const int threads = fused::row_threads(hidden, fused::kPack<T>);
    add_layer_norm_forward_kernel<T><<<static_cast<unsigned>(rows), threads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(residual), static_cast<const T*>(weight),
        static_cast<const T*>(bias), static_cast<T*>(out), static_cast<T*>(sum), mean, rstd, hidden,
        eps, vectorise);
    return cudaGetLastError();
  });
}

int add_layer_norm_backward_blocks(int64_t rows, int64_t hidden, bool has_bias, FusedType type) {
  if (rows <= 0 || hidden <= 0) return 0;
  int sms = 0;
  int per_sm = 0;
  const cudaError_t err = fused::dispatch(type, [&](auto tag) {
    return backward_blocks_per_sm<decltype(tag)>(hidden, has_bias, &per_sm, &sms);
  });
  if (err != cudaSuccess || per_sm < 1) {
    cudaGetLastError();  // clear it: the caller answers "does not fit" and falls back
    return 0;
  }
  // One full wave: every block resident at once, each with about rows / blocks rows.
  const int64_t blocks = static_cast<int64_t>(sms) * per_sm;
  return static_cast<int>(blocks < rows ? blocks : rows);
}

cudaError_t add_layer_norm_backward(const void* grad_out, const void* grad_sum, const void* s,
                                    const void* weight, const float* mean, const float* rstd,
                                    void* grad_in, void* grad_weight, void* grad_bias,
                                    float* workspace, int64_t rows, int64_t hidden, int blocks,
                                    FusedType type, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (hidden <= 0 || blocks < 1) return cudaErrorInvalidValue;
  const bool has_bias = grad_bias != nullptr;
  return fused::dispatch(type, [&](auto tag) {
    using T = decltype(tag);
    size_t smem = 0;
    BackwardLimits limits;
    cudaError_t err = backward_shared_bytes<T>(hidden, has_bias, &smem, &limits);
    if (err != cudaSuccess) return err;
    float* partial_weight = workspace;
    float* partial_bias = has_bias ? workspace + static_cast<int64_t>(blocks) * hidden : nullptr;
    const bool vectorise = aligned_alike<T>(hidden, {s, grad_out, grad_sum, weight, grad_in});
    const int threads = fused::row_threads(hidden, fused::kPack<T>);
    add_layer_norm_backward_kernel<T><<<blocks, threads, smem, stream>>>(
        static_cast<const T*>(grad_out), static_cast<const T*>(grad_sum), static_cast<const T*>(s),
        static_cast<const T*>(weight), mean, rstd, static_cast<T*>(grad_in), partial_weight,
        partial_bias, rows, hidden, vectorise);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    const dim3 grid(static_cast<unsigned>(fused::ceil_div(hidden, kSumColumns)), has_bias ? 2 : 1);
    column_sum_kernel<T><<<grid, dim3(kSumColumns, kSumGroups), 0, stream>>>(
        workspace, static_cast<T*>(grad_weight), static_cast<T*>(grad_bias), blocks, hidden);
    return cudaGetLastError();
  });
}

}  // namespace megart::cuda
