// The ops of the shm transport as tasks: collectives through the staging areas, point-to-point
// through the rings.
#pragma once

#include <memory>

#include "comm/shm/communicator.hpp"

namespace megart::comm::shm {

std::shared_ptr<Task> make_all_reduce(Buffer inout, ReduceOp op);
std::shared_ptr<Task> make_all_gather(Buffer in, Buffer out);
std::shared_ptr<Task> make_reduce_scatter(Buffer in, Buffer out, ReduceOp op);
std::shared_ptr<Task> make_broadcast(Buffer inout, int root);
std::shared_ptr<Task> make_barrier();
std::shared_ptr<Task> make_send(Buffer buffer, int me, int peer);
std::shared_ptr<Task> make_recv(Buffer buffer, int me, int peer);

}  // namespace megart::comm::shm
