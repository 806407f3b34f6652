// The NCCL stand-in's kernels: a collective round run by the last rank to arrive, the
// point-to-point exchanges of a group, and how a launch is put on its CUDA streams.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <thread>
#include <tuple>

#include "nccl_standin_state.hpp"

namespace nccl_standin {
namespace {

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

void p2p_kernel(Comm* c, const std::vector<P2P>& ops) {
  Clique& q = *c->clique;
  std::unique_lock<std::mutex> lock(q.mu);
  std::vector<std::pair<std::shared_ptr<Message>, int>> big;  // with the receiving peer
  // This launch's share of each peer's messages, and its index among the launches with it.
  std::map<int, std::pair<std::size_t, std::size_t>> counts;  // peer: sends, receives
  for (const P2P& op : ops) ++(op.send ? counts[op.peer].first : counts[op.peer].second);
  std::map<int, std::uint64_t> launch;
  for (const auto& [peer, n] : counts) launch[peer] = c->p2p_launches[peer]++;
  // A group progresses all its ops together: every send is posted before any receive waits.
  for (const P2P& op : ops) {
    if (!op.send) continue;
    auto m = std::make_shared<Message>();
    const char* src = static_cast<const char*>(op.buf);
    m->bytes.assign(src, src + op.count * type_size(op.type));
    m->type = op.type;
    m->launch = launch[op.peer];
    std::tie(m->sends, m->recvs) = counts[op.peer];
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
    const auto [sends, recvs] = counts[op.peer];
    if (m->launch != launch[op.peer] || m->sends != recvs || m->recvs != sends) {
      {
        std::lock_guard<std::mutex> l(c->mu);
        c->last_error = "rank " + std::to_string(op.peer) + " grouped its messages to rank " +
                        std::to_string(c->rank) + " differently (its launch " +
                        std::to_string(m->launch) + " holds " + std::to_string(m->sends) +
                        " send(s) and " + std::to_string(m->recvs) + " receive(s) with it; " +
                        "this launch " + std::to_string(launch[op.peer]) + " holds " +
                        std::to_string(recvs) + " receive(s) and " + std::to_string(sends) +
                        " send(s)): undefined in NCCL";
      }
      c->state = kInvalidUsage;
      // As a failed NCCL kernel: it never completes (until the communicator is aborted), so
      // the error is what the waiting caller sees, not a result.
      wait_peers(c, lock, [] { return false; }, {op.peer});
      return;
    } else if (m->bytes.size() != want || m->type != op.type) {
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

}  // namespace

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

}  // namespace nccl_standin
