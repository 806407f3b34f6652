// What the NCCL stand-in's sources share: NCCL's result codes and enums, the communicators and
// cliques of ranks (threads of one process), the launches of collective and point-to-point
// kernels, and the functions each source provides to the others. Internal to the stand-in;
// nccl_standin.cpp is the C API megart's transport loads.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "cuda_runtime.h"

namespace nccl_standin {

using Result = int;
constexpr Result kSuccess = 0, kUnhandledCuda = 1, kSystemError = 2, kInternalError = 3,
                 kInvalidArgument = 4, kInvalidUsage = 5, kRemoteError = 6, kInProgress = 7;
enum DataType { kInt8, kUint8, kInt32, kUint32, kInt64, kUint64, kF16, kF32, kF64, kBf16 };
enum RedOp { kSum, kProd, kMax, kMin, kAvg };
constexpr int kSplitNoColor = -1;  // NCCL_SPLIT_NOCOLOR
constexpr unsigned kConfigMagic = 0xcafebeef;

int env_int(const char* name, int fallback);
// The version this stand-in reports: 2.23.4 by default (MEGART_STANDIN_NCCL_VERSION), the first
// with NCCL's "every group call of a non-blocking communicator runs in a new thread and answers
// ncclInProgress".
int version_code();
// Sends larger than this (MEGART_STANDIN_EAGER_BYTES) wait for their receive, as NCCL's do once
// a message outgrows its buffers (NCCL_BUFFSIZE, 4 MiB by default); smaller ones complete eagerly.
std::size_t eager_bytes();

// Element values (nccl_standin_values.cpp).
std::size_t type_size(int t);
// Reduces n inputs elementwise in double (integers up to 2^53 exactly) and rounds once.
void reduce_into(void* out, const std::vector<const void*>& in, std::size_t count, int t, int op);

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
// A point-to-point message, with where its sender grouped it: the index of the sender's launch
// among its launches with the receiver, and how many sends to and receives from the receiver
// that launch held. The receiver's launch must hold the same messages (NCCL leaves other
// groupings undefined).
struct Message {
  std::vector<char> bytes;
  int type;
  std::uint64_t launch = 0;
  std::size_t sends = 0, recvs = 0;
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
  std::map<int, std::uint64_t> p2p_launches;  // per peer; touched only by this comm's kernels
};

struct P2P {
  bool send;
  void* buf;
  std::size_t count;
  int type, peer;
  cudaStream_t stream;
};

// What a group (or a lone call, an implicit group) launches.
struct Launch {
  Comm* comm = nullptr;
  std::vector<P2P> p2p;
  std::vector<std::pair<Part, cudaStream_t>> colls;
};

// Communicators and the calling thread's group (nccl_standin_comm.cpp).
extern std::mutex g_mu;
extern std::map<std::string, std::shared_ptr<Clique>> g_cliques;  // by unique id
extern std::set<Comm*> g_comms;                                   // live handles
extern thread_local std::string t_last_error;
extern thread_local int t_group_depth;
extern thread_local std::vector<Launch> t_group;
// How many calls ran in a background thread (nccl_standin_kernels.cpp).
extern std::atomic<unsigned long long> g_async_calls;

Result error(Comm* c, Result r, const std::string& text);
bool live(Comm* c);
Result check_comm(Comm* c, const char* fn);
Result check_buffer(Comm* c, const void* p, std::size_t count, int type, const char* fn);
// Adds a launch to the calling thread's group, or submits it when no group is open.
Result add(Launch op);
Result collective(Coll kind, const void* send, void* recv, std::size_t count, int type, int op,
                  int root, Comm* c, cudaStream_t stream, const char* fn);
Comm* new_comm(std::shared_ptr<Clique> q, int rank, bool blocking);
Result init(Comm** out, int nranks, const char* id, int rank, bool blocking);
void mark_gone(Comm* c);

// Kernels (nccl_standin_kernels.cpp): puts a launch on its streams, from a new thread for
// non-blocking communicators.
Result submit(const Launch& l);

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

}  // namespace nccl_standin
