// The ops of the shm transport as tasks: collectives through the staging areas, point-to-point
// through the rings.
#pragma once

#include <cstdint>
#include <memory>

#include "comm/shm/communicator.hpp"

namespace megart::comm::shm {

// Where a point-to-point op sits among the ops between its two ranks: the index of its batch
// among this rank's batches with that peer, and how many sends to and receives from the peer
// that batch holds. NCCL matches two ranks' ops only when both group them alike (the same
// messages between them in each group), so the receiver checks the sender's grouping against
// its own and refuses a mismatch, which NCCL would leave undefined.
struct PairGroup {
  std::uint64_t index = 0;
  std::uint32_t sends = 0;
  std::uint32_t recvs = 0;
};

std::shared_ptr<Task> make_all_reduce(Buffer inout, ReduceOp op);
std::shared_ptr<Task> make_all_gather(Buffer in, Buffer out);
std::shared_ptr<Task> make_reduce_scatter(Buffer in, Buffer out, ReduceOp op);
std::shared_ptr<Task> make_broadcast(Buffer inout, int root);
std::shared_ptr<Task> make_barrier();
std::shared_ptr<Task> make_send(Buffer buffer, int me, int peer, PairGroup group);
std::shared_ptr<Task> make_recv(Buffer buffer, int me, int peer, PairGroup group);

}  // namespace megart::comm::shm
