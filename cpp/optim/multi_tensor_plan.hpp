// How a list of tensors is packed into multi-tensor kernel launches.
//
// A multi-tensor CUDA kernel takes its tensor list by value in the kernel arguments, which have a
// fixed size limit, so one launch holds at most kMaxTensors tensor slots and kMaxBlocks blocks;
// each block processes one chunk (a fixed number of elements) of the tensor in one slot. The
// packing is host code with no CUDA in it: it lives here, in the core, so that the C++ unit tests
// run it on machines without a GPU, and every kernel in cuda/kernels packs the same way.
#pragma once

#include <cstdint>

namespace megart::optim {

// Which slot and which chunk each block of a launch processes, in the form the kernels receive
// it (a kernel's argument struct holds one and copies it from the plan): a byte per slot and an
// int per chunk keep the arguments under their size limit.
template <int kMaxBlocks>
struct MultiTensorBlockMap {
  unsigned char slot[kMaxBlocks];
  int chunk[kMaxBlocks];
};

// One launch: the grid has `blocks` blocks; block b processes elements
// [block_map.chunk[b] * chunk, min((block_map.chunk[b] + 1) * chunk, size)) of the tensor in
// slot block_map.slot[b], and slot s holds the caller's tensor number tensor[s].
template <int kMaxTensors, int kMaxBlocks>
struct MultiTensorLaunch {
  static_assert(kMaxTensors > 0 && kMaxBlocks > 0, "a launch needs a slot and a block");
  static_assert(kMaxTensors <= 256, "MultiTensorBlockMap holds a slot in one byte");
  int tensors = 0;  // slots in use
  int blocks = 0;   // blocks in use
  int tensor[kMaxTensors] = {};
  MultiTensorBlockMap<kMaxBlocks> block_map = {};
};

// Walks sizes[0..count) in order (chunk > 0 elements per block) and calls
// launch(const MultiTensorLaunch&) for each launch. Launches are packed greedily: a launch is
// handed over when its blocks are all used, when its slots are all used and another tensor
// comes, or at the end. A tensor whose chunks do not fit continues in the next launch, where it
// takes slot 0. Empty tensors take no slot, so an empty list (or one of empty tensors) launches
// nothing, and no slot is ever left without a block.
// `launch` returns a Status (a cudaError_t, a bool); the first one that is not `ok` stops the
// walk and is returned, otherwise `ok` is. Chunk indices are int, as the kernels read them:
// that bounds a tensor at 2^31 chunks (2^45 elements with the kernels' chunks).
template <int kMaxTensors, int kMaxBlocks, typename Status, typename LaunchFn>
Status plan_multi_tensor(const int64_t* sizes, int count, int64_t chunk, Status ok,
                         LaunchFn&& launch) {
  MultiTensorLaunch<kMaxTensors, kMaxBlocks> plan;
  // The callback only reads the plan: the next launch reuses the same storage.
  const MultiTensorLaunch<kMaxTensors, kMaxBlocks>& view = plan;
  for (int t = 0; t < count; ++t) {
    if (sizes[t] <= 0) continue;
    if (plan.tensors == kMaxTensors) {
      // Every slot has at least one block, so this launch is never empty.
      if (const Status status = launch(view); !(status == ok)) return status;
      plan.tensors = 0;
      plan.blocks = 0;
    }
    int slot = plan.tensors++;
    plan.tensor[slot] = t;
    // Rounded up without forming sizes[t] + chunk - 1, which could overflow.
    const int64_t chunks = sizes[t] / chunk + (sizes[t] % chunk != 0 ? 1 : 0);
    for (int64_t c = 0; c < chunks; ++c) {
      plan.block_map.slot[plan.blocks] = static_cast<unsigned char>(slot);
      plan.block_map.chunk[plan.blocks] = static_cast<int>(c);
      // Handed over as soon as it is full (not when the next block comes), so that a tensor
      // ending exactly at the limit leaves the next tensor a fresh launch without a stray slot.
      if (++plan.blocks == kMaxBlocks) {
        if (const Status status = launch(view); !(status == ok)) return status;
        plan.blocks = 0;
        plan.tensors = 0;
        if (c + 1 < chunks) {
          slot = plan.tensors++;
          plan.tensor[slot] = t;
        }
      }
    }
  }
  return plan.blocks == 0 ? ok : launch(view);
}

}  // namespace megart::optim
