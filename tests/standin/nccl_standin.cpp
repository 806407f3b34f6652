// The NCCL stand-in: the part of NCCL's C API that megart's nccl transport loads at run time
// (cuda/comm/nccl_api.cpp), implemented on the CUDA runtime stand-in, for ranks that are threads
// of one process. Built as libnccl.so-like shared library and loaded through
// MEGART_NCCL_LIBRARY, exactly as a real NCCL is. BEHAVIOUR.md says which document each
// behaviour follows and where the stand-in is simpler than NCCL. This file is the API; the
// communicators, kernels and element values are in nccl_standin_{comm,kernels,values}.cpp.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cuda_runtime.h"
#include "nccl_standin_state.hpp"

using namespace nccl_standin;  // NOLINT: the API is written in the stand-in's own terms

extern "C" {

struct NcclUniqueIdStandin {
  char internal[128];
};
struct NcclConfigStandin {  // ncclConfig_t's first fields, as in every NCCL from 2.14
  std::size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
};

Result ncclGetVersion(int* version) {
  if (version == nullptr) return kInvalidArgument;
  *version = version_code();
  return kSuccess;
}

Result ncclGetUniqueId(NcclUniqueIdStandin* id) {
  if (id == nullptr) return kInvalidArgument;
  static std::mt19937_64 rng(std::random_device{}());
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  for (auto& b : id->internal) b = static_cast<char>(rng());
  return kSuccess;
}

const char* ncclGetErrorString(Result r) {
  switch (r) {
    case kSuccess:
      return "no error";
    case kUnhandledCuda:
      return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case kSystemError:
      return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case kInternalError:
      return "internal error - please report this issue to the NCCL developers";
    case kInvalidArgument:
      return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case kInvalidUsage:
      return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case kRemoteError:
      return "remote process exited or there was a network error";
    case kInProgress:
      return "NCCL operation in progress";
  }
  return "unknown result code";
}

const char* ncclGetLastError(Comm* comm) {
  if (comm != nullptr && live(comm)) {
    std::lock_guard<std::mutex> lock(comm->mu);
    if (!comm->last_error.empty()) {
      t_last_error = comm->last_error;
    }
  }
  return t_last_error.c_str();
}

Result ncclCommInitRank(Comm** comm, int nranks, NcclUniqueIdStandin id, int rank) {
  return init(comm, nranks, id.internal, rank, true);
}

Result ncclCommInitRankConfig(Comm** comm, int nranks, NcclUniqueIdStandin id, int rank,
                              NcclConfigStandin* config) {
  bool blocking = true;
  if (config != nullptr) {
    if (config->magic != kConfigMagic || config->size < sizeof(NcclConfigStandin)) {
      return error(nullptr, kInvalidArgument,
                   "ncclCommInitRankConfig: config not initialised "
                   "with NCCL_CONFIG_INITIALIZER");
    }
    blocking = config->blocking != 0;  // NCCL_CONFIG_UNDEF_INT and 1 mean blocking
  }
  return init(comm, nranks, id.internal, rank, blocking);
}

Result ncclCommSplit(Comm* comm, int color, int key, Comm** newcomm, NcclConfigStandin* config) {
  if (Result r = check_comm(comm, "ncclCommSplit"); r != kSuccess) return r;
  if (newcomm == nullptr) return error(comm, kInvalidArgument, "ncclCommSplit: newcomm is null");
  bool blocking = comm->blocking;  // the parent's configuration unless one is given
  if (config != nullptr) {
    if (config->magic != kConfigMagic)
      return error(comm, kInvalidArgument, "ncclCommSplit: bad config");
    if (config->blocking != INT_MIN) blocking = config->blocking != 0;
  }
  *newcomm = nullptr;
  std::uint64_t seq;
  {
    std::lock_guard<std::mutex> lock(comm->mu);
    seq = comm->split_seq++;
  }
  // The split is a host-side collective over the parent: each rank posts (color, key), and
  // the ranks of one color form a clique ordered by key, then parent rank.
  auto work = [comm, color, key, seq, blocking](Comm** out) -> Result {
    cudaSetDevice(comm->device);  // the new communicator is on the parent's device
    Clique& q = *comm->clique;
    std::unique_lock<std::mutex> lock(q.mu);
    auto& posted = q.splits[seq];
    if (posted.empty()) posted.assign(q.size, {INT_MIN, 0});
    posted[comm->rank] = {color, key};
    q.cv.notify_all();
    std::vector<int> peers;
    for (int k = 0; k < q.size; ++k) {
      if (k != comm->rank) peers.push_back(k);
    }
    if (!wait_peers(
            comm, lock,
            [&] {
              for (auto& p : q.splits[seq]) {
                if (p.first == INT_MIN) return false;
              }
              return true;
            },
            peers)) {
      return kInvalidUsage;
    }
    if (color == kSplitNoColor) return kSuccess;
    std::vector<std::pair<int, int>> same;  // (key, parent rank)
    for (int k = 0; k < q.size; ++k) {
      if (q.splits[seq][k].first == color) same.push_back({q.splits[seq][k].second, k});
    }
    std::sort(same.begin(), same.end());
    int new_rank = 0;
    while (same[new_rank].second != comm->rank) ++new_rank;
    const std::string id = "split:" + std::to_string(reinterpret_cast<std::uintptr_t>(&q)) + ":" +
                           std::to_string(seq) + ":" + std::to_string(color);
    lock.unlock();
    std::string padded = id;
    padded.resize(128, '\0');
    Comm* c = nullptr;
    const Result r = init(&c, static_cast<int>(same.size()), padded.data(), new_rank, true);
    if (c != nullptr) c->blocking = blocking;
    *out = c;
    return r;
  };
  if (!comm->blocking) {
    // Answered at once with ncclInProgress; the child is polled with ncclCommGetAsyncError.
    auto* child = new_comm(std::make_shared<Clique>(1), 0, blocking);
    child->state = kInProgress;
    *newcomm = child;
    comm->state = kInProgress;
    std::thread([work, child, comm] {
      Comm* made = nullptr;
      const Result r = work(&made);
      if (made != nullptr) {
        // The handle the caller holds becomes the real member of the new clique.
        std::lock_guard<std::mutex> lock(made->clique->mu);
        child->clique = made->clique;
        child->rank = made->rank;
        child->blocking = made->blocking;
        made->clique->members[made->rank] = child;
        std::lock_guard<std::mutex> g(g_mu);
        g_comms.erase(made);
      }
      delete made;
      comm->state = kSuccess;
      child->state = r;
    }).detach();
    return kInProgress;
  }
  return work(newcomm);
}

Result ncclCommGetAsyncError(Comm* comm, Result* state) {
  if (comm == nullptr || state == nullptr || !live(comm)) return kInvalidArgument;
  *state = comm->state;
  return kSuccess;
}

Result ncclCommFinalize(Comm* comm) {
  if (Result r = check_comm(comm, "ncclCommFinalize"); r != kSuccess) return r;
  std::shared_ptr<Done> last;
  {
    std::lock_guard<std::mutex> lock(comm->mu);
    last = comm->last;
  }
  // Flushes the communicator's work; non-blocking communicators do it in the background.
  if (comm->blocking) {
    if (last) last->wait();
    comm->finalized = true;
    return kSuccess;
  }
  comm->state = kInProgress;
  std::thread([comm, last] {
    if (last) last->wait();
    comm->finalized = true;
    comm->state = kSuccess;
  }).detach();
  return kInProgress;
}

Result ncclCommDestroy(Comm* comm) {
  if (comm == nullptr || !live(comm))
    return error(nullptr, kInvalidArgument, "ncclCommDestroy: invalid communicator");
  std::shared_ptr<Done> last;
  {
    std::lock_guard<std::mutex> lock(comm->mu);
    last = comm->last;
  }
  if (!comm->finalized && last) last->wait();  // destroy waits for queued work
  mark_gone(comm);
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_comms.erase(comm);
  }
  // Kernels already finished; the object is kept (not freed) so that a late stream item of an
  // aborted peer never touches freed memory in this test stand-in.
  return kSuccess;
}

Result ncclCommAbort(Comm* comm) {
  if (comm == nullptr || !live(comm))
    return error(nullptr, kInvalidArgument, "ncclCommAbort: invalid communicator");
  comm->aborted = true;  // its waiting kernels end
  mark_gone(comm);
  {
    std::lock_guard<std::mutex> lock(g_mu);
    g_comms.erase(comm);
  }
  return kSuccess;
}

Result ncclGroupStart() {
  ++t_group_depth;
  return kSuccess;
}

Result ncclGroupEnd() {
  if (t_group_depth == 0)
    return error(nullptr, kInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  if (--t_group_depth > 0) return kSuccess;
  std::vector<Launch> group = std::move(t_group);
  t_group.clear();
  Result result = kSuccess;
  for (auto& l : group) {
    // A send to or receive from this rank itself needs its match in the same group.
    int self_sends = 0, self_recvs = 0;
    for (const auto& op : l.p2p) {
      if (op.peer == l.comm->rank) (op.send ? self_sends : self_recvs)++;
    }
    if (self_sends != self_recvs) {
      return error(l.comm, kInvalidUsage, "send/recv to self without its match in the group");
    }
    const Result r = submit(l);
    if (r != kSuccess) result = r;
  }
  return result;
}

Result ncclAllReduce(const void* send, void* recv, std::size_t count, int type, int op, Comm* comm,
                     cudaStream_t stream) {
  return collective(Coll::AllReduce, send, recv, count, type, op, 0, comm, stream, "ncclAllReduce");
}

Result ncclAllGather(const void* send, void* recv, std::size_t count, int type, Comm* comm,
                     cudaStream_t stream) {
  return collective(Coll::AllGather, send, recv, count, type, kSum, 0, comm, stream,
                    "ncclAllGather");
}

Result ncclReduceScatter(const void* send, void* recv, std::size_t count, int type, int op,
                         Comm* comm, cudaStream_t stream) {
  return collective(Coll::ReduceScatter, send, recv, count, type, op, 0, comm, stream,
                    "ncclReduceScatter");
}

Result ncclBroadcast(const void* send, void* recv, std::size_t count, int type, int root,
                     Comm* comm, cudaStream_t stream) {
  return collective(Coll::Broadcast, send, recv, count, type, kSum, root, comm, stream,
                    "ncclBroadcast");
}

Result ncclSend(const void* buf, std::size_t count, int type, int peer, Comm* comm,
                cudaStream_t stream) {
  if (Result r = check_comm(comm, "ncclSend"); r != kSuccess) return r;
  if (Result r = check_buffer(comm, buf, count, type, "ncclSend"); r != kSuccess) return r;
  if (peer < 0 || peer >= comm->clique->size)
    return error(comm, kInvalidArgument, "ncclSend: invalid peer");
  if (peer == comm->rank && t_group_depth == 0) {
    return error(comm, kInvalidUsage, "ncclSend to self outside a group");
  }
  Launch l;
  l.comm = comm;
  l.p2p.push_back({true, const_cast<void*>(buf), count, type, peer, stream});
  return add(std::move(l));
}

Result ncclRecv(void* buf, std::size_t count, int type, int peer, Comm* comm, cudaStream_t stream) {
  if (Result r = check_comm(comm, "ncclRecv"); r != kSuccess) return r;
  if (Result r = check_buffer(comm, buf, count, type, "ncclRecv"); r != kSuccess) return r;
  if (peer < 0 || peer >= comm->clique->size)
    return error(comm, kInvalidArgument, "ncclRecv: invalid peer");
  if (peer == comm->rank && t_group_depth == 0) {
    return error(comm, kInvalidUsage, "ncclRecv from self outside a group");
  }
  Launch l;
  l.comm = comm;
  l.p2p.push_back({false, buf, count, type, peer, stream});
  return add(std::move(l));
}

// Not NCCL: makes this rank's process "exit" for its peers (tests of a dead peer). Its kernels
// end; every peer waiting on it sees ncclRemoteError, as when a real process dies.
void megartStandinKill(Comm* comm) {
  comm->aborted = true;
  mark_gone(comm);
}

}  // extern "C"

extern "C" {
// Not NCCL: every communicator on `device` behaves as if its process had exited: its kernels
// end, and peers waiting on it see ncclRemoteError (tests of a dead peer).
void megartStandinKillDevice(int device) {
  std::vector<Comm*> victims;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    for (Comm* c : g_comms) {
      if (c->device == device) victims.push_back(c);
    }
  }
  for (Comm* c : victims) megartStandinKill(c);
}
// Not NCCL: how many calls ran in a background thread (non-blocking communicators).
unsigned long long megartStandinAsyncCalls() { return g_async_calls.load(); }
}
