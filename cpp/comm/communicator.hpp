// One API for every transport: collectives and point-to-point on raw buffers, each op returning
// a Work. Group ranks are 0..size-1; the Python layer maps them to global ranks.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/types.hpp"

namespace megart::comm {

// The handle of one op in flight.
class Work {
 public:
  virtual ~Work() = default;
  // True once the op has finished (or failed); never blocks, may advance progress.
  virtual bool is_completed() = 0;
  // Blocks the calling thread until the op finishes; throws its error (a CommError naming this
  // rank, the op, the peer and the group) if it failed or timed out.
  virtual void wait() = 0;
};
using WorkPtr = std::shared_ptr<Work>;

// A point-to-point op of a batch. `peer` is a group rank.
struct P2POp {
  bool send = true;
  Buffer buffer;
  int peer = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const std::string& name() const = 0;  // names the group in error messages

  virtual WorkPtr all_reduce(Buffer inout, ReduceOp op) = 0;
  // out holds size() * in.count elements, rank q's input at q * in.count.
  virtual WorkPtr all_gather(Buffer in, Buffer out) = 0;
  // in holds size() * out.count elements; this rank gets the reduction of its slice.
  virtual WorkPtr reduce_scatter(Buffer in, Buffer out, ReduceOp op) = 0;
  virtual WorkPtr broadcast(Buffer inout, int root) = 0;
  // All ops of a batch progress together, so a ring exchange in both directions never
  // deadlocks. Between two ranks, sends and receives match in the order they are posted.
  virtual std::vector<WorkPtr> batch_p2p(const std::vector<P2POp>& ops) = 0;
  virtual WorkPtr barrier() = 0;
  // Fails every op in flight on every rank of the group, which then raise instead of waiting.
  virtual void abort() = 0;

  // Bytes this rank has sent to each group rank through point-to-point ops since the last reset.
  virtual std::vector<std::uint64_t> bytes_sent() const = 0;
  virtual void reset_bytes_sent() = 0;
};

}  // namespace megart::comm
