// The NCCL stand-in: the part of NCCL's C API that megart's nccl transport loads at run time
// (cuda/comm/nccl_api.cpp), implemented on the CUDA runtime stand-in, for ranks that are threads
// of one process. Built as libnccl.so-like shared library and loaded through
// MEGART_NCCL_LIBRARY, exactly as a real NCCL is. BEHAVIOUR.md says which document each
// behaviour follows and where the stand-in is simpler than NCCL.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/half.hpp"
#include "cuda_runtime.h"
#include "standin.h"

namespace {

using Result = int;
constexpr Result kSuccess = 0, kUnhandledCuda = 1, kSystemError = 2, kInternalError = 3,
                 kInvalidArgument = 4, kInvalidUsage = 5, kRemoteError = 6, kInProgress = 7;
enum DataType { kInt8, kUint8, kInt32, kUint32, kInt64, kUint64, kF16, kF32, kF64, kBf16 };
enum RedOp { kSum, kProd, kMax, kMin, kAvg };
constexpr int kSplitNoColor = -1;  // NCCL_SPLIT_NOCOLOR
constexpr unsigned kConfigMagic = 0xcafebeef;

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoi(v) : fallback;
}

// The version this stand-in reports: 2.23.4 by default, the first with NCCL's "every group call
// of a non-blocking communicator runs in a new thread and answers ncclInProgress".
int version_code() { return env_int("MEGART_STANDIN_NCCL_VERSION", 22304); }
// Sends larger than this wait for their receive, as NCCL's do once a message outgrows its
// buffers (NCCL_BUFFSIZE, 4 MiB by default); smaller ones complete eagerly.
std::size_t eager_bytes() {
  return static_cast<std::size_t>(env_int("MEGART_STANDIN_EAGER_BYTES", 4 << 20));
}

std::size_t type_size(int t) {
  switch (t) {
    case kInt8:
    case kUint8:
      return 1;
    case kF16:
    case kBf16:
      return 2;
    case kInt32:
    case kUint32:
    case kF32:
      return 4;
    case kInt64:
    case kUint64:
    case kF64:
      return 8;
  }
  return 0;
}

double load(const void* p, std::size_t i, int t) {
  switch (t) {
    case kInt8:
      return static_cast<const std::int8_t*>(p)[i];
    case kUint8:
      return static_cast<const std::uint8_t*>(p)[i];
    case kInt32:
      return static_cast<const std::int32_t*>(p)[i];
    case kUint32:
      return static_cast<const std::uint32_t*>(p)[i];
    case kInt64:
      return static_cast<double>(static_cast<const std::int64_t*>(p)[i]);
    case kUint64:
      return static_cast<double>(static_cast<const std::uint64_t*>(p)[i]);
    case kF16:
      return megart::to_float(static_cast<const megart::FP16*>(p)[i]);
    case kBf16:
      return megart::to_float(static_cast<const megart::BF16*>(p)[i]);
    case kF32:
      return static_cast<const float*>(p)[i];
    case kF64:
      return static_cast<const double*>(p)[i];
  }
  return 0;
}

void store(void* p, std::size_t i, int t, double v) {
  switch (t) {
    case kInt8:
      static_cast<std::int8_t*>(p)[i] = static_cast<std::int8_t>(v);
      return;
    case kUint8:
      static_cast<std::uint8_t*>(p)[i] = static_cast<std::uint8_t>(v);
      return;
    case kInt32:
      static_cast<std::int32_t*>(p)[i] = static_cast<std::int32_t>(v);
      return;
    case kUint32:
      static_cast<std::uint32_t*>(p)[i] = static_cast<std::uint32_t>(v);
      return;
    case kInt64:
      static_cast<std::int64_t*>(p)[i] = static_cast<std::int64_t>(v);
      return;
    case kUint64:
      static_cast<std::uint64_t*>(p)[i] = static_cast<std::uint64_t>(v);
      return;
    case kF16:
      megart::store(static_cast<megart::FP16*>(p) + i, static_cast<float>(v));
      return;
    case kBf16:
      megart::store(static_cast<megart::BF16*>(p) + i, static_cast<float>(v));
      return;
    case kF32:
      static_cast<float*>(p)[i] = static_cast<float>(v);
      return;
    case kF64:
      static_cast<double*>(p)[i] = v;
      return;
  }
}

// Reduces n inputs elementwise in double (integers up to 2^53 exactly) and rounds once.
void reduce_into(void* out, const std::vector<const void*>& in, std::size_t count, int t, int op) {
  std::vector<double> acc(count);
  for (std::size_t i = 0; i < count; ++i) {
    double a = load(in[0], i, t);
    for (std::size_t r = 1; r < in.size(); ++r) {
      const double b = load(in[r], i, t);
      switch (op) {
        case kSum:
        case kAvg:
          a += b;
          break;
        case kProd:
          a *= b;
          break;
        case kMax:
          a = std::max(a, b);
          break;
        case kMin:
          a = std::min(a, b);
          break;
      }
    }
    if (op == kAvg) a /= static_cast<double>(in.size());
    acc[i] = a;
  }
  for (std::size_t i = 0; i < count; ++i) store(out, i, t, acc[i]);
}

struct Comm;

// One kernel of a collective as a rank launched it; the last rank to arrive runs the round.
enum class Coll { AllReduce, AllGather, ReduceScatter, Broadcast, Barrier };
struct Part {
  Coll kind;
  const void* send;
  void* recv;
  std::size_t count;
  int type, op, root;
};
struct Round {
  std::vector<Part> parts;
  std::vector<bool> arrived;
  int arrivals = 0, left = 0;
  bool finished = false;
};
struct Message {
  std::vector<char> bytes;
  int type;
  bool consumed = false;
};

// The ranks made from one unique id (or one split): what NCCL's peers share over the network.
struct Clique {
  explicit Clique(int n) : size(n), members(n, nullptr), gone(n, false), rounds_seq(n, 0) {}
  const int size;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Comm*> members;
  int joined = 0;
  std::vector<bool> gone;  // exited (megartStandinKill) or aborted: never arrives again
  std::map<std::uint64_t, Round> rounds;
  std::vector<std::uint64_t> rounds_seq;
  std::map<std::pair<int, int>, std::vector<std::shared_ptr<Message>>> channels;  // src, dst
  std::map<std::uint64_t, std::vector<std::pair<int, int>>> splits;  // round -> (color, key)
  std::uint64_t split_rounds = 0;
};

struct Done {  // completion of one launched kernel of a communicator
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  void set() {
    {
      std::lock_guard<std::mutex> lock(mu);
      done = true;
    }
    cv.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done; });
  }
};

struct Comm {
  std::shared_ptr<Clique> clique;
  int rank = 0, device = 0;
  bool blocking = true;
  std::atomic<int> state{kSuccess};  // ncclCommGetAsyncError's answer
  std::atomic<bool> aborted{false};
  std::atomic<bool> finalized{false};
  std::mutex mu;               // guards last, split_seq and last_error
  std::shared_ptr<Done> last;  // NCCL orders each kernel after the communicator's previous one
  std::uint64_t split_seq = 0;
  std::string last_error;
};

std::mutex g_mu;
std::map<std::string, std::shared_ptr<Clique>> g_cliques;  // by unique id
std::set<Comm*> g_comms;                                   // live handles
thread_local std::string t_last_error;

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

// A kernel that waits on its peers spins on the GPU until they come or the communicator is
// aborted; a peer that has gone turns this communicator's asynchronous state into
// ncclRemoteError, as NCCL's proxy does when a connection closes, while the kernel keeps
// waiting for the abort. Returns false when aborted (the kernel ends without its result).
template <typename Pred>
bool wait_peers(Comm* c, std::unique_lock<std::mutex>& lock, Pred ready,
                const std::vector<int>& peers) {
  Clique& q = *c->clique;
  while (!ready()) {
    if (c->aborted) return false;
    for (int p : peers) {
      if (q.gone[p] && c->state == kSuccess) {
        c->state = kRemoteError;
        std::lock_guard<std::mutex> l(c->mu);
        c->last_error = "remote process exited or there was a network error (rank " +
                        std::to_string(p) + " is gone)";
      }
    }
    q.cv.wait_for(lock, std::chrono::milliseconds(5));
  }
  return !c->aborted;
}

void run_round(Clique& q, Round& r, Comm* c) {
  // Runs on the last rank to arrive, under q.mu: every part's buffers are ready (each rank's
  // kernel is waiting here), so reading and writing all of them is what the kernels together do.
  const Part& p0 = r.parts[0];
  for (const Part& p : r.parts) {
    if (p.kind != p0.kind || p.count != p0.count || p.type != p0.type || p.op != p0.op ||
        p.root != p0.root) {
      for (Comm* m : q.members) {
        if (m == nullptr) continue;
        m->state = kInvalidUsage;
        std::lock_guard<std::mutex> l(m->mu);
        m->last_error =
            "collective mismatch: ranks called different collectives, counts, types "
            "or roots at the same position";
      }
      return;
    }
  }
  (void)c;
  const int n = q.size;
  const std::size_t es = type_size(p0.type);
  std::vector<std::vector<char>> staged(n);
  switch (p0.kind) {
    case Coll::AllReduce:
    case Coll::Barrier: {
      std::vector<const void*> in;
      for (const Part& p : r.parts) in.push_back(p.send);
      std::vector<char> out(p0.count * es);
      reduce_into(out.data(), in, p0.count, p0.type, p0.op);
      for (const Part& p : r.parts) std::memcpy(p.recv, out.data(), out.size());
      break;
    }
    case Coll::AllGather: {
      std::vector<char> out(p0.count * es * n);
      for (int k = 0; k < n; ++k) {
        std::memcpy(out.data() + k * p0.count * es, r.parts[k].send, p0.count * es);
      }
      for (const Part& p : r.parts) std::memcpy(p.recv, out.data(), out.size());
      break;
    }
    case Coll::ReduceScatter: {
      for (int k = 0; k < n; ++k) {
        std::vector<const void*> in;
        for (const Part& p : r.parts)
          in.push_back(static_cast<const char*>(p.send) + k * p0.count * es);
        staged[k].resize(p0.count * es);
        reduce_into(staged[k].data(), in, p0.count, p0.type, p0.op);
      }
      for (int k = 0; k < n; ++k) std::memcpy(r.parts[k].recv, staged[k].data(), staged[k].size());
      break;
    }
    case Coll::Broadcast: {
      std::vector<char> out(static_cast<const char*>(r.parts[p0.root].send),
                            static_cast<const char*>(r.parts[p0.root].send) + p0.count * es);
      for (const Part& p : r.parts) std::memcpy(p.recv, out.data(), out.size());
      break;
    }
  }
}

// One collective kernel of rank c: arrive at round `seq`, run it if last, wait for the result.
void collective_kernel(Comm* c, std::uint64_t seq, const Part& part) {
  Clique& q = *c->clique;
  std::unique_lock<std::mutex> lock(q.mu);
  Round& r = q.rounds[seq];
  if (r.parts.empty()) {
    r.parts.resize(q.size);
    r.arrived.assign(q.size, false);
  }
  r.parts[c->rank] = part;
  r.arrived[c->rank] = true;
  if (++r.arrivals == q.size) {
    run_round(q, r, c);
    r.finished = true;
    q.cv.notify_all();
  }
  std::vector<int> peers;
  for (int k = 0; k < q.size; ++k) {
    if (k != c->rank) peers.push_back(k);
  }
  Round* rp = &r;
  wait_peers(c, lock, [&] { return rp->finished; }, peers);
  if (++rp->left == q.size) q.rounds.erase(seq);
}

struct P2P {
  bool send;
  void* buf;
  std::size_t count;
  int type, peer;
  cudaStream_t stream;
};

void p2p_kernel(Comm* c, const std::vector<P2P>& ops) {
  Clique& q = *c->clique;
  std::unique_lock<std::mutex> lock(q.mu);
  std::vector<std::pair<std::shared_ptr<Message>, int>> big;  // with the receiving peer
  // A group progresses all its ops together: every send is posted before any receive waits.
  for (const P2P& op : ops) {
    if (!op.send) continue;
    auto m = std::make_shared<Message>();
    const char* src = static_cast<const char*>(op.buf);
    m->bytes.assign(src, src + op.count * type_size(op.type));
    m->type = op.type;
    q.channels[{c->rank, op.peer}].push_back(m);
    if (m->bytes.size() > eager_bytes()) big.push_back({m, op.peer});
  }
  q.cv.notify_all();
  for (const P2P& op : ops) {
    if (op.send) continue;
    auto& channel = q.channels[{op.peer, c->rank}];
    if (!wait_peers(c, lock, [&] { return !channel.empty(); }, {op.peer})) return;
    auto m = channel.front();
    channel.erase(channel.begin());
    const std::size_t want = op.count * type_size(op.type);
    if (m->bytes.size() != want || m->type != op.type) {
      c->state = kInvalidUsage;
      std::lock_guard<std::mutex> l(c->mu);
      c->last_error = "message size mismatch: rank " + std::to_string(op.peer) + " sent " +
                      std::to_string(m->bytes.size()) + " bytes, rank " + std::to_string(c->rank) +
                      " receives " + std::to_string(want);
    }
    std::memcpy(op.buf, m->bytes.data(), std::min(want, m->bytes.size()));
    m->consumed = true;
    q.cv.notify_all();
  }
  for (auto& [m, peer] : big) {
    if (!wait_peers(c, lock, [&, m = m] { return m->consumed; }, {peer})) return;
  }
}

// What a group (or a lone call, an implicit group) launches.
struct Launch {
  Comm* comm = nullptr;
  std::vector<P2P> p2p;
  std::vector<std::pair<Part, cudaStream_t>> colls;
};
thread_local int t_group_depth = 0;
thread_local std::vector<Launch> t_group;

struct HostTask {
  std::function<void()> fn;
};
void host_trampoline(void* p) {
  std::unique_ptr<HostTask> task(static_cast<HostTask*>(p));
  task->fn();
}
bool enqueue(cudaStream_t s, std::function<void()> fn) {
  auto* task = new HostTask{std::move(fn)};
  if (cudaLaunchHostFunc(s, host_trampoline, task) != cudaSuccess) {
    delete task;
    return false;
  }
  return true;
}

// Puts one launch on its streams. NCCL runs a group as one kernel on the first op's stream after
// making it wait for the group's other streams, which then wait for the kernel (the streams are
// joined around it); the kernel also follows the communicator's previous kernel.
Result enqueue_launch(const Launch& l) {
  Comm* c = l.comm;
  std::vector<cudaStream_t> streams;
  for (const auto& op : l.p2p) streams.push_back(op.stream);
  for (const auto& [part, s] : l.colls) streams.push_back(s);
  std::vector<cudaStream_t> unique;
  for (auto s : streams) {
    if (std::find(unique.begin(), unique.end(), s) == unique.end()) unique.push_back(s);
  }
  if (unique.empty()) return kSuccess;
  auto done = std::make_shared<Done>();
  std::shared_ptr<Done> previous;
  std::vector<std::uint64_t> seqs;
  {
    std::lock_guard<std::mutex> lock(c->mu);
    previous = c->last;
    c->last = done;
  }
  {
    std::lock_guard<std::mutex> lock(c->clique->mu);
    for (std::size_t i = 0; i < l.colls.size(); ++i)
      seqs.push_back(c->clique->rounds_seq[c->rank]++);
  }
  auto joined = std::make_shared<std::atomic<int>>(0);
  const int others = static_cast<int>(unique.size()) - 1;
  for (std::size_t i = 1; i < unique.size(); ++i) {
    if (!enqueue(unique[i], [joined, done] {
          joined->fetch_add(1);
          done->wait();
        })) {
      return kUnhandledCuda;
    }
  }
  const bool ok = enqueue(unique[0], [c, l, seqs, previous, done, joined, others] {
    while (joined->load() < others) std::this_thread::sleep_for(std::chrono::microseconds(20));
    if (previous) previous->wait();
    if (!c->aborted) {
      for (std::size_t i = 0; i < l.colls.size() && !c->aborted; ++i) {
        collective_kernel(c, seqs[i], l.colls[i].first);
      }
      if (!l.p2p.empty() && !c->aborted) p2p_kernel(c, l.p2p);
    }
    done->set();
  });
  return ok ? kSuccess : kUnhandledCuda;
}

std::atomic<unsigned long long> g_async_calls{0};

// Non-blocking communicators from NCCL 2.23 run every group call in a new thread and answer
// ncclInProgress; the state stays ncclInProgress until the work is on its streams.
Result submit(const Launch& l) {
  Comm* c = l.comm;
  if (!c->blocking && version_code() >= 22300) {
    c->state = kInProgress;
    ++g_async_calls;
    std::thread([l, c] {
      static thread_local std::mt19937 rng(std::random_device{}());
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 300));
      const Result r = enqueue_launch(l);
      int expected = kInProgress;
      c->state.compare_exchange_strong(expected, r);
    }).detach();
    return kInProgress;
  }
  return enqueue_launch(l);
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

}  // namespace

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
