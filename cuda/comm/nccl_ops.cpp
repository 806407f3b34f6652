// Ran on one GPU only (see nccl_communicator.hpp). The ops of NcclCommunicator: each checks its
// buffers, orders its stream after the caller's, enqueues NCCL and records an event for its Work.
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "comm/cuda_util.hpp"
#include "comm/nccl_api.hpp"
#include "comm/nccl_communicator.hpp"
#include "common/error.hpp"

namespace megart::cuda {

using comm::Buffer;
using comm::ReduceOp;
using comm::StreamHandle;
using comm::WorkPtr;

namespace {

std::string shape(const Buffer& b) {
  return std::to_string(b.count) + " x " + comm::dtype_name(b.dtype);
}

std::string all_peers(int size) {
  return size == 1 ? std::string("rank 0") : "ranks 0.." + std::to_string(size - 1);
}

}  // namespace

template <typename Enqueue>
WorkPtr NcclCommunicator::collective(const std::string& what, StreamHandle caller, const char* call,
                                     std::string peers, Enqueue enqueue) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable(what);
  DeviceGuard guard(device_);
  check_cuda(guard.error(), set_device_call(), what);
  after_caller(caller, send_stream_, what);
  check_nccl(enqueue(), call, what);
  return make_work(record(send_stream_, what), what, std::move(peers));
}

WorkPtr NcclCommunicator::all_reduce(Buffer inout, ReduceOp op, StreamHandle stream) {
  const std::string what = "all_reduce(" + shape(inout) + ", " + comm::reduce_op_name(op) + ")";
  check_buffer(inout, what);
  const int type = nccl_dtype(inout.dtype, what);
  const int red = nccl_op(op, what);
  return collective(what, stream, "ncclAllReduce", all_peers(size_), [&] {
    return api_->all_reduce(inout.data, inout.data, inout.count, type, red, comm_, send_stream_);
  });
}

WorkPtr NcclCommunicator::all_gather(Buffer in, Buffer out, StreamHandle stream) {
  const std::string what = "all_gather(" + shape(in) + " per rank)";
  check_buffer(in, what);
  check_buffer(out, what);
  if (const auto wrong = comm::split_mismatch(out, in, size_, "output", "input"); !wrong.empty()) {
    throw ConfigError(where() + ": " + what + ": " + wrong);
  }
  const int type = nccl_dtype(in.dtype, what);
  return collective(what, stream, "ncclAllGather", all_peers(size_), [&] {
    return api_->all_gather(in.data, out.data, in.count, type, comm_, send_stream_);
  });
}

WorkPtr NcclCommunicator::reduce_scatter(Buffer in, Buffer out, ReduceOp op, StreamHandle stream) {
  const std::string what =
      "reduce_scatter(" + shape(out) + " per rank, " + comm::reduce_op_name(op) + ")";
  check_buffer(in, what);
  check_buffer(out, what);
  if (const auto wrong = comm::split_mismatch(in, out, size_, "input", "output"); !wrong.empty()) {
    throw ConfigError(where() + ": " + what + ": " + wrong);
  }
  const int type = nccl_dtype(in.dtype, what);
  const int red = nccl_op(op, what);
  return collective(what, stream, "ncclReduceScatter", all_peers(size_), [&] {
    return api_->reduce_scatter(in.data, out.data, out.count, type, red, comm_, send_stream_);
  });
}

WorkPtr NcclCommunicator::broadcast(Buffer inout, int root, StreamHandle stream) {
  const std::string what = "broadcast(" + shape(inout) + ", root " + std::to_string(root) + ")";
  check_buffer(inout, what);
  if (root < 0 || root >= size_) {
    throw ConfigError(where() + ": " + what + ": the root must be a group rank in [0, " +
                      std::to_string(size_) + ")");
  }
  const int type = nccl_dtype(inout.dtype, what);
  std::string peers = root == rank_ ? all_peers(size_) : "rank " + std::to_string(root);
  return collective(what, stream, "ncclBroadcast", std::move(peers), [&] {
    return api_->broadcast(inout.data, inout.data, inout.count, type, root, comm_, send_stream_);
  });
}

std::vector<WorkPtr> NcclCommunicator::batch_p2p(const std::vector<comm::P2POp>& ops,
                                                 StreamHandle stream) {
  std::vector<std::string> whats;
  std::vector<int> types;
  bool any_send = false, any_recv = false;
  for (const auto& op : ops) {
    const std::string what = std::string(op.send ? "send(" : "recv(") + shape(op.buffer) +
                             (op.send ? " to rank " : " from rank ") + std::to_string(op.peer) +
                             ")";
    check_buffer(op.buffer, what);
    if (op.peer < 0 || op.peer >= size_) {
      throw ConfigError(where() + ": " + what + ": the peer must be a group rank in [0, " +
                        std::to_string(size_) + ")");
    }
    types.push_back(nccl_dtype(op.buffer.dtype, what));
    whats.push_back(what);
    (op.send ? any_send : any_recv) = true;
  }
  std::vector<WorkPtr> works;
  if (ops.empty()) return works;
  // Names the ops (and so the peers) in every error of the batch: the first few, then a count.
  std::string batch = "batch_p2p of " + std::to_string(ops.size()) + " op(s): " + whats[0];
  for (std::size_t i = 1; i < whats.size() && i < 4; ++i) batch += ", " + whats[i];
  if (whats.size() > 4) batch += ", ...";
  std::lock_guard<std::mutex> lock(mu_);
  check_usable(batch);
  DeviceGuard guard(device_);
  check_cuda(guard.error(), set_device_call(), batch);
  // One caller event; both streams wait on it.
  check_cuda(cudaEventRecord(caller_ready_, reinterpret_cast<cudaStream_t>(stream)),
             "cudaEventRecord on the caller's stream", batch);
  if (any_send) {
    check_cuda(cudaStreamWaitEvent(send_stream_, caller_ready_, 0), "cudaStreamWaitEvent", batch);
  }
  if (any_recv) {
    check_cuda(cudaStreamWaitEvent(recv_stream_, caller_ready_, 0), "cudaStreamWaitEvent", batch);
  }
  check_nccl(api_->group_start(), "ncclGroupStart", batch);
  NcclResult failed = kNcclSuccess;
  bool in_progress = false;
  std::string failed_call;
  for (std::size_t i = 0; i < ops.size() && failed == kNcclSuccess; ++i) {
    const auto& op = ops[i];
    const NcclResult r =
        op.send
            ? api_->send(op.buffer.data, op.buffer.count, types[i], op.peer, comm_, send_stream_)
            : api_->recv(op.buffer.data, op.buffer.count, types[i], op.peer, comm_, recv_stream_);
    if (r == kNcclInProgress) {
      in_progress = true;  // a non-blocking communicator's state; settled after ncclGroupEnd
    } else if (r != kNcclSuccess) {
      failed = r;
      failed_call = std::string(op.send ? "ncclSend" : "ncclRecv") + " for " + whats[i];
    }
  }
  // The group is always closed, even after a failed call, so NCCL's group state stays sane.
  NcclResult ended = api_->group_end();
  if (failed != kNcclSuccess) check_nccl(failed, failed_call, batch);  // throws
  // On a non-blocking communicator ncclGroupEnd answers ncclInProgress while NCCL connects and
  // launches in the background: nothing is on the streams until the state is success, so the
  // completion events below are recorded only after check_nccl has polled it out.
  if (in_progress && ended == kNcclSuccess) ended = kNcclInProgress;
  check_nccl(ended, "ncclGroupEnd", batch);
  const auto sends = any_send ? record(send_stream_, batch) : nullptr;
  const auto recvs = any_recv ? record(recv_stream_, batch) : nullptr;
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const auto& op = ops[i];
    if (op.send) sent_[op.peer].fetch_add(op.buffer.bytes(), std::memory_order_relaxed);
    works.push_back(
        make_work(op.send ? sends : recvs, whats[i], "rank " + std::to_string(op.peer)));
  }
  return works;
}

WorkPtr NcclCommunicator::barrier() {
  const std::string what = "barrier()";
  std::lock_guard<std::mutex> lock(mu_);
  check_usable(what);
  DeviceGuard guard(device_);
  check_cuda(guard.error(), set_device_call(), what);
  check_nccl(api_->all_reduce(barrier_buffer_, barrier_buffer_, 1, kNcclInt32, kNcclSum, comm_,
                              send_stream_),
             "ncclAllReduce", what);
  return make_work(record(send_stream_, what), what, all_peers(size_));
}

void NcclCommunicator::abort() {
  std::lock_guard<std::mutex> lock(mu_);
  break_group("aborted by rank " + std::to_string(rank_));
}

std::vector<std::uint64_t> NcclCommunicator::bytes_sent() const {
  std::vector<std::uint64_t> out;
  for (const auto& s : sent_) out.push_back(s.load());
  return out;
}

void NcclCommunicator::reset_bytes_sent() {
  for (auto& s : sent_) s.store(0);
}

}  // namespace megart::cuda
