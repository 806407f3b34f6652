#include "schedule/validate.hpp"

#include <algorithm>
#include <map>
#include <sstream>
#include <tuple>
#include <utility>

#include "common/error.hpp"
#include "schedule/dataflow.hpp"

namespace megart::schedule {

namespace {

// Where each action of one rank sits, by (op, microbatch, chunk); -1 when absent.
class Positions {
 public:
  Positions(const Schedule& s, int rank, std::vector<std::string>& out) : s_(s) {
    pos_.assign(static_cast<size_t>(kNumOps) * s.microbatches * s.chunks, -1);
    const auto& actions = s.ranks[rank];
    for (int i = 0; i < static_cast<int>(actions.size()); ++i) {
      const Action& a = actions[i];
      const std::string where = "rank " + std::to_string(rank) + ": " + to_string(a);
      if (a.microbatch < 0 || a.microbatch >= s.microbatches || a.chunk < 0 ||
          a.chunk >= s.chunks) {
        out.push_back(where + " is out of range (microbatches " + std::to_string(s.microbatches) +
                      ", chunks " + std::to_string(s.chunks) + ")");
        continue;
      }
      int& slot = pos_[index(a.op, a.microbatch, a.chunk)];
      if (slot >= 0) {
        out.push_back(where + " appears twice");
        continue;
      }
      slot = i;
    }
  }
  int operator()(Op op, int mb, int chunk) const { return pos_[index(op, mb, chunk)]; }

 private:
  size_t index(Op op, int mb, int chunk) const {
    return (static_cast<size_t>(op) * s_.microbatches + mb) * s_.chunks + chunk;
  }
  const Schedule& s_;
  std::vector<int> pos_;
};

void check_compute(const Schedule& s, int rank, const Positions& at,
                   std::vector<std::string>& out) {
  const std::string who = "rank " + std::to_string(rank) + ": ";
  for (int mb = 0; mb < s.microbatches; ++mb) {
    for (int c = 0; c < s.chunks; ++c) {
      const std::string what = "(mb=" + std::to_string(mb) + ", chunk=" + std::to_string(c) + ")";
      const int f = at(Op::Forward, mb, c);
      const int b = at(Op::Backward, mb, c);
      const int i = at(Op::BackwardInput, mb, c);
      const int w = at(Op::BackwardWeight, mb, c);
      if (f < 0) out.push_back(who + "no F" + what);
      if (s.forward_only) {
        if (b >= 0 || i >= 0 || w >= 0) {
          out.push_back(who + "a backward of " + what + " in a forward-only schedule");
        }
        continue;
      }
      if (b >= 0 && (i >= 0 || w >= 0)) {
        out.push_back(who + "B" + what + " together with a split backward I/W");
      } else if (b < 0 && (i < 0 || w < 0)) {
        out.push_back(who + "no backward for " + what + " (need B, or I and W)");
      } else if (b < 0 && w < i) {
        out.push_back(who + "W" + what + " comes before I" + what);
      }
      const int first_backward = b >= 0 ? b : i;
      if (f >= 0 && first_backward >= 0 && first_backward < f) {
        out.push_back(who + "backward of " + what + " comes before its F");
      }
    }
  }
}

// Each compute's receive must come before it and its send after it, with the right peer; no
// communication action may stand without its compute.
void check_communication(const Schedule& s, int rank, const Positions& at,
                         std::vector<std::string>& out) {
  const std::string who = "rank " + std::to_string(rank) + ": ";
  int expected_comm = 0;
  for (const Action& a : s.ranks[rank]) {
    if (!is_compute(a.op) || a.microbatch < 0 || a.microbatch >= s.microbatches || a.chunk < 0 ||
        a.chunk >= s.chunks) {
      continue;
    }
    const int here = at(a.op, a.microbatch, a.chunk);
    if (auto local = local_input_of(s, rank, a)) {
      const int p = at(local->op, local->microbatch, local->chunk);
      if (p < 0 || p > here) {
        out.push_back(who + to_string(a) + " takes the result of " + to_string(*local) +
                      " on the same rank, which " + (p < 0 ? "is missing" : "comes after it"));
      }
    }
    if (auto recv = input_of(s, rank, a)) {
      ++expected_comm;
      const int p = at(recv->op, recv->microbatch, recv->chunk);
      if (p < 0) {
        out.push_back(who + to_string(a) + " has no " + to_string(*recv) + " before it");
      } else if (p > here) {
        out.push_back(who + to_string(*recv) + " comes after " + to_string(a) + ", which needs it");
      } else if (s.ranks[rank][p].peer != recv->peer) {
        out.push_back(who + to_string(s.ranks[rank][p]) + " names the wrong peer; expected " +
                      std::to_string(recv->peer));
      }
    }
    if (auto send = output_of(s, rank, a)) {
      ++expected_comm;
      const int p = at(send->op, send->microbatch, send->chunk);
      if (p < 0) {
        out.push_back(who + to_string(a) + " has no " + to_string(*send) + " after it");
      } else if (p < here) {
        out.push_back(who + to_string(*send) + " comes before " + to_string(a) + ", its producer");
      } else if (s.ranks[rank][p].peer != send->peer) {
        out.push_back(who + to_string(s.ranks[rank][p]) + " names the wrong peer; expected " +
                      std::to_string(send->peer));
      }
    }
  }
  int comm = 0;
  for (const Action& a : s.ranks[rank]) comm += is_compute(a.op) ? 0 : 1;
  if (comm > expected_comm) {
    out.push_back(who + std::to_string(comm - expected_comm) +
                  " communication action(s) that no compute needs or produces");
  }
}

// Between every pair, the k-th send of one is the k-th receive of the other.
void check_matching(const Schedule& s, std::vector<std::string>& out) {
  std::map<std::pair<int, int>, std::vector<std::pair<Message, Action>>> sends, recvs;
  for (int rank = 0; rank < s.stages; ++rank) {
    for (const Action& a : s.ranks[rank]) {
      if (is_compute(a.op)) continue;
      auto m = message_of(s, rank, a);
      if (!m) continue;  // reported by check_communication
      (is_send(a.op) ? sends : recvs)[{m->src, m->dst}].emplace_back(*m, a);
    }
  }
  auto pairs = sends;
  for (const auto& [key, list] : recvs) pairs.emplace(key, decltype(list){});
  for (const auto& [key, unused] : pairs) {
    const auto& tx = sends[key];
    const auto& rx = recvs[key];
    const auto [src, dst] = key;
    const std::string link =
        "from rank " + std::to_string(src) + " to rank " + std::to_string(dst) + ": ";
    for (size_t k = 0; k < std::min(tx.size(), rx.size()); ++k) {
      if (!(tx[k].first == rx[k].first)) {
        out.push_back(link + "message " + std::to_string(k) + " is " + to_string(tx[k].second) +
                      " on the sender but " + to_string(rx[k].second) +
                      " on the receiver; receives must follow the sender's order");
        break;
      }
    }
    if (tx.size() != rx.size()) {
      out.push_back(link + std::to_string(tx.size()) + " send(s) but " + std::to_string(rx.size()) +
                    " receive(s)");
    }
  }
}

}  // namespace

std::vector<std::string> problems(const Schedule& s) {
  std::vector<std::string> out;
  if (s.stages < 1 || s.microbatches < 1 || s.chunks < 1) {
    out.push_back("stages, microbatches and chunks must be at least 1");
    return out;
  }
  if (static_cast<int>(s.ranks.size()) != s.stages) {
    out.push_back("the schedule has " + std::to_string(s.ranks.size()) + " rank lists for " +
                  std::to_string(s.stages) + " stages");
    return out;
  }
  for (int rank = 0; rank < s.stages; ++rank) {
    Positions at(s, rank, out);
    check_compute(s, rank, at, out);
    check_communication(s, rank, at, out);
  }
  check_matching(s, out);
  return out;
}

void validate(const Schedule& s) {
  const auto found = problems(s);
  if (found.empty()) return;
  std::ostringstream msg;
  msg << "invalid " << kind_name(s.kind) << " schedule (" << found.size() << " problem"
      << (found.size() == 1 ? "" : "s") << "): ";
  const size_t shown = std::min<size_t>(found.size(), 5);
  for (size_t i = 0; i < shown; ++i) msg << (i ? "; " : "") << found[i];
  if (found.size() > shown) msg << "; ...";
  throw ScheduleError(msg.str());
}

}  // namespace megart::schedule
