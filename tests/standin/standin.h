// What the stand-ins offer beyond the APIs they stand in for, for the NCCL stand-in and the
// tests only. Nothing in cuda/comm includes this.
#pragma once

#include <cstddef>

extern "C" {
// The device a cudaMalloc'd address belongs to, or -1 for memory cudaMalloc did not hand out
// (CUDA's cudaPointerGetAttributes answers this on a GPU).
int megartStandinPointerDevice(const void* ptr);
// Items currently queued or running on `stream` (0 when idle).
std::size_t megartStandinStreamPending(void* stream);
// Re-seeds every stream's delay generator and sets the largest delay before each item, in
// microseconds (defaults: MEGART_STANDIN_SEED, MEGART_STANDIN_MAX_DELAY_US or 200).
void megartStandinConfigure(unsigned long long seed, unsigned int max_delay_us);
// Events created and not yet destroyed (a transport that creates one per op shows here).
unsigned long long megartStandinLiveEvents();
// Events created so far.
unsigned long long megartStandinEventsCreated();
}
