// The NCCL stand-in's communicators: cliques made from a unique id, the argument checks NCCL
// makes, errors and their text, and the calling thread's group.
#include <chrono>
#include <cstdlib>
#include <thread>

#include "nccl_standin_state.hpp"
#include "standin.h"

namespace nccl_standin {

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoi(v) : fallback;
}

int version_code() { return env_int("MEGART_STANDIN_NCCL_VERSION", 22304); }
std::size_t eager_bytes() {
  return static_cast<std::size_t>(env_int("MEGART_STANDIN_EAGER_BYTES", 4 << 20));
}

std::mutex g_mu;
std::map<std::string, std::shared_ptr<Clique>> g_cliques;
std::set<Comm*> g_comms;
thread_local std::string t_last_error;
thread_local int t_group_depth = 0;
thread_local std::vector<Launch> t_group;

Result error(Comm* c, Result r, const std::string& text) {
  t_last_error = text;
  if (c != nullptr) {
    std::lock_guard<std::mutex> lock(c->mu);
    c->last_error = text;
  }
  return r;
}

bool live(Comm* c) {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_comms.count(c) > 0;
}

Result check_comm(Comm* c, const char* fn) {
  if (c == nullptr || !live(c))
    return error(nullptr, kInvalidArgument, std::string(fn) + ": invalid communicator");
  if (c->state == kInProgress) {
    return error(c, kInvalidUsage,
                 std::string(fn) +
                     ": the communicator's previous call is still in progress "
                     "(poll ncclCommGetAsyncError until it is not ncclInProgress)");
  }
  if (c->state != kSuccess)
    return error(c, c->state.load(), std::string(fn) + ": communicator in error state");
  return kSuccess;
}

Result check_buffer(Comm* c, const void* p, std::size_t count, int type, const char* fn) {
  if (type < kInt8 || type > kBf16)
    return error(c, kInvalidArgument, std::string(fn) + ": invalid data type");
  if (count == 0) return kSuccess;
  if (p == nullptr) return error(c, kInvalidArgument, std::string(fn) + ": null buffer");
  if (megartStandinPointerDevice(p) != c->device) {
    return error(c, kInvalidArgument,
                 std::string(fn) + ": buffer is not device memory of the communicator's device " +
                     std::to_string(c->device));
  }
  return kSuccess;
}

Result add(Launch op) {
  if (t_group_depth > 0) {
    for (auto& l : t_group) {
      if (l.comm == op.comm) {
        l.p2p.insert(l.p2p.end(), op.p2p.begin(), op.p2p.end());
        l.colls.insert(l.colls.end(), op.colls.begin(), op.colls.end());
        return kSuccess;
      }
    }
    t_group.push_back(std::move(op));
    return kSuccess;
  }
  return submit(op);
}

Result collective(Coll kind, const void* send, void* recv, std::size_t count, int type, int op,
                  int root, Comm* c, cudaStream_t stream, const char* fn) {
  if (Result r = check_comm(c, fn); r != kSuccess) return r;
  const std::size_t n = static_cast<std::size_t>(c->clique->size);
  const std::size_t send_count = kind == Coll::ReduceScatter ? count * n : count;
  const std::size_t recv_count = kind == Coll::AllGather ? count * n : count;
  if (Result r = check_buffer(c, send, send_count, type, fn); r != kSuccess) return r;
  if (Result r = check_buffer(c, recv, recv_count, type, fn); r != kSuccess) return r;
  if (op < kSum || op > kAvg)
    return error(c, kInvalidArgument, std::string(fn) + ": invalid reduction");
  if (op == kAvg && (type != kF16 && type != kF32 && type != kF64 && type != kBf16)) {
    return error(c, kInvalidArgument, std::string(fn) + ": ncclAvg needs a floating-point type");
  }
  if (root < 0 || root >= c->clique->size)
    return error(c, kInvalidArgument, std::string(fn) + ": invalid root");
  Launch l;
  l.comm = c;
  l.colls.push_back({Part{kind, send, recv, count, type, op, root}, stream});
  return add(std::move(l));
}

Comm* new_comm(std::shared_ptr<Clique> q, int rank, bool blocking) {
  auto* c = new Comm;
  c->clique = std::move(q);
  c->rank = rank;
  cudaGetDevice(&c->device);
  c->blocking = blocking;
  std::lock_guard<std::mutex> lock(g_mu);
  g_comms.insert(c);
  return c;
}

namespace {

// Every rank of the clique has joined; NCCL refuses two ranks on one GPU ("Duplicate GPU").
Result join(Comm* c) {
  Clique& q = *c->clique;
  std::unique_lock<std::mutex> lock(q.mu);
  q.members[c->rank] = c;
  ++q.joined;
  q.cv.notify_all();
  while (q.joined < q.size) {
    if (c->aborted) return kInvalidUsage;
    q.cv.wait_for(lock, std::chrono::milliseconds(5));
  }
  for (int k = 0; k < q.size; ++k) {
    if (k != c->rank && q.members[k] != nullptr && q.members[k]->device == c->device) {
      return error(c, kInvalidUsage,
                   "Duplicate GPU detected: rank " + std::to_string(c->rank) + " and rank " +
                       std::to_string(k) + " both on device " + std::to_string(c->device));
    }
  }
  return kSuccess;
}

}  // namespace

Result init(Comm** out, int nranks, const char* id, int rank, bool blocking) {
  if (out == nullptr || nranks < 1 || rank < 0 || rank >= nranks) {
    return error(nullptr, kInvalidArgument, "ncclCommInitRank: invalid rank or size");
  }
  std::shared_ptr<Clique> q;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto& slot = g_cliques[std::string(id, 128)];
    if (!slot) slot = std::make_shared<Clique>(nranks);
    q = slot;
  }
  if (q->size != nranks)
    return error(nullptr, kInvalidArgument, "ncclCommInitRank: nranks differs between ranks");
  Comm* c = new_comm(q, rank, blocking);
  *out = c;
  if (blocking) {
    const Result r = join(c);
    if (r != kSuccess) c->state = r;
    return r;
  }
  c->state = kInProgress;
  std::thread([c] {
    const Result r = join(c);
    int expected = kInProgress;
    c->state.compare_exchange_strong(expected, r);
  }).detach();
  return kInProgress;
}

void mark_gone(Comm* c) {
  Clique& q = *c->clique;
  std::lock_guard<std::mutex> lock(q.mu);
  q.gone[c->rank] = true;
  q.cv.notify_all();
}

}  // namespace nccl_standin
