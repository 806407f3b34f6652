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

// A device stream as an opaque integer: a cudaStream_t for the nccl transport, 0 for the default
// (legacy) stream. The core never includes CUDA; host transports ignore streams.
using StreamHandle = std::uintptr_t;

// The handle of one op in flight.
class Work {
 public:
  virtual ~Work() = default;
  // True once the op has finished (or failed); never blocks, may advance progress.
  virtual bool is_completed() = 0;
  // Blocks the calling thread until the op finishes; throws its error (a CommError naming this
  // rank, the op, the peer and the group) if it failed or timed out.
  virtual void wait() = 0;
  // Orders `stream` after this op without blocking the host where the transport can (nccl: the
  // stream waits on the op's event). Host transports have nothing to order on a device, so the
  // default is wait(): when it returns, the op's buffers are final for every stream.
  virtual void wait_stream(StreamHandle stream) {
    (void)stream;
    wait();
  }
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

  // `stream` on every op is the caller's stream, the one that produced the inputs and will read
  // the outputs: a device transport orders the op after the work already queued on it (without
  // blocking the host); host transports ignore it.
  virtual WorkPtr all_reduce(Buffer inout, ReduceOp op, StreamHandle stream) = 0;
  // out holds size() * in.count elements, rank q's input at q * in.count.
  virtual WorkPtr all_gather(Buffer in, Buffer out, StreamHandle stream) = 0;
  // in holds size() * out.count elements; this rank gets the reduction of its slice.
  virtual WorkPtr reduce_scatter(Buffer in, Buffer out, ReduceOp op, StreamHandle stream) = 0;
  virtual WorkPtr broadcast(Buffer inout, int root, StreamHandle stream) = 0;
  // All ops of a batch progress together, so a ring exchange in both directions never
  // deadlocks. Between two ranks, sends and receives match in the order they are posted.
  virtual std::vector<WorkPtr> batch_p2p(const std::vector<P2POp>& ops, StreamHandle stream) = 0;
  virtual WorkPtr barrier() = 0;
  // Fails every op in flight on every rank of the group, which then raise instead of waiting.
  virtual void abort() = 0;

  // Bytes this rank has sent to each group rank through point-to-point ops since the last reset.
  virtual std::vector<std::uint64_t> bytes_sent() const = 0;
  virtual void reset_bytes_sent() = 0;
};

}  // namespace megart::comm
