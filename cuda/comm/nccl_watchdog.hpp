// One watchdog thread per process, as torch's ProcessGroupNCCL has: it polls every live nccl
// communicator's ops in flight and NCCL's asynchronous error, and on an error or an op past its
// timeout aborts that communicator and ends the process with a message naming the rank, the op,
// its peers and the group. Without it a dead peer is seen only inside a wait, and a host sync
// that is not one (loss.item(), a device copy) would hang forever.
//
// MEGART_NCCL_WATCHDOG=0 turns it off (errors then surface at the next wait, is_completed or op
// of the group); MEGART_NCCL_WATCHDOG_INTERVAL_MS sets its polling period (default 100 ms).
#pragma once

#include <memory>

namespace megart::cuda {

class NcclCommunicator;

// Watches `comm` for as long as it lives; starts the thread on first use (unless turned off).
void watch(const std::shared_ptr<NcclCommunicator>& comm);

// Exit status of a process the watchdog ended.
constexpr int kWatchdogExitStatus = 86;

}  // namespace megart::cuda
