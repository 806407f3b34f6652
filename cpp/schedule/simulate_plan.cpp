// Times a posting plan (post_plan.hpp) the way NCCL runs it: see simulate_plan in simulate.hpp.
//
// A group is one NCCL kernel on its rank's stream: it starts after the computes posted before it
// (its sends' tensors, and the stream's order) and after the rank's previous group; each of its
// messages moves once the group at the other end has started too (and the link has carried the
// messages before it); the group ends with its last message, and a compute that needs one of its
// receives waits for that end. Every time is a maximum of earlier ones, so the plan is a graph of
// events, resolved in whatever order their dependencies allow.
#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/error.hpp"
#include "schedule/dataflow.hpp"
#include "schedule/post_plan.hpp"
#include "schedule/simulate.hpp"
#include "schedule/state_machine.hpp"

namespace megart::schedule {

namespace {

constexpr double kUnknown = -1;

struct Group {
  int rank = 0;
  size_t computes_before = 0;     // computes of its rank posted before it
  std::vector<Action> messages;   // in posting order
  std::vector<size_t> transfers;  // into PlanTimer::transfers_
  double start = kUnknown;
  double end = kUnknown;
};

// One message: a send and its receive, the k-th of their direction on both sides.
struct Transfer {
  size_t send_group = 0;
  size_t recv_group = 0;
  double end = kUnknown;
};

class PlanTimer {
 public:
  PlanTimer(const Schedule& s, const Costs& c, const Costs& planned_for) : s_(s), costs_(c) {
    const int p = s.stages;
    computes_.resize(p);
    compute_end_.resize(p);
    groups_of_.resize(p);
    const std::vector<std::vector<Step>> plan = post_plan(s, planned_for);
    for (int r = 0; r < p; ++r) {
      for (const Step& st : plan[r]) {
        if (st.compute) {
          computes_[r].push_back(*st.compute);
        } else {
          groups_of_[r].push_back(groups_.size());
          groups_.push_back(Group{r, computes_[r].size(), st.post, {}});
        }
      }
      compute_end_[r].assign(computes_[r].size(), kUnknown);
    }
    cursors_.resize(p);
    pair_messages();
  }

  Simulation run() {
    // Each pass takes every rank and link as far as known times allow; the plan's order
    // guarantees progress, so a pass that resolves nothing means the plan cannot run.
    const size_t total = computes_count() + 2 * groups_.size() + transfers_.size();
    size_t resolved = 0;
    while (resolved < total) {
      const size_t before = resolved;
      for (int r = 0; r < s_.stages; ++r) resolved += advance_rank(r);
      for (Link& link : links_) resolved += advance_link(link);
      if (resolved == before) {
        throw DeadlockError("the " + std::string(kind_name(s_.kind)) +
                            " posting plan cannot progress: a group waits on a later one");
      }
    }
    return summarise();
  }

 private:
  // A rank's progress: the next group to start, the next to end, the next compute.
  struct Cursor {
    size_t start = 0, end = 0, compute = 0;
  };
  // A directed link's messages in order, and the next one to resolve.
  struct Link {
    std::vector<size_t> transfers;
    size_t next = 0;
  };

  size_t computes_count() const {
    size_t n = 0;
    for (const auto& c : computes_) n += c.size();
    return n;
  }

  double cost(const Action& a, int rank) const { return costs_.of(a, s_.chunks, rank); }

  static std::tuple<int, int, int, int> key(int rank, const Action& recv) {
    return {rank, static_cast<int>(recv.op), recv.microbatch, recv.chunk};
  }

  // Pairs every send with its receive as NCCL does: the k-th message of a direction on both
  // sides.
  void pair_messages() {
    std::map<std::pair<int, int>, std::pair<std::vector<size_t>, std::vector<size_t>>> ends;
    for (size_t g = 0; g < groups_.size(); ++g) {
      const int r = groups_[g].rank;
      for (const Action& a : groups_[g].messages) {
        if (is_send(a.op)) {
          ends[{r, a.peer}].first.push_back(g);
        } else {
          ends[{a.peer, r}].second.push_back(g);
          recv_group_[key(r, a)] = g;
        }
      }
    }
    for (const auto& [direction, sides] : ends) {
      Link link;
      for (size_t k = 0; k < std::min(sides.first.size(), sides.second.size()); ++k) {
        const size_t t = transfers_.size();
        transfers_.push_back(Transfer{sides.first[k], sides.second[k]});
        groups_[sides.first[k]].transfers.push_back(t);
        groups_[sides.second[k]].transfers.push_back(t);
        link.transfers.push_back(t);
      }
      links_.push_back(std::move(link));
    }
  }

  // Takes rank r's group starts, group ends and computes as far as known times allow; returns
  // how many times it resolved.
  size_t advance_rank(int r) {
    Cursor& at = cursors_[r];
    const std::vector<size_t>& mine = groups_of_[r];
    size_t resolved = 0;
    for (bool progress = true; progress;) {
      progress = false;
      if (at.start < mine.size() && at.end == at.start) {  // the previous group has ended
        Group& g = groups_[mine[at.start]];
        if (at.compute >= g.computes_before) {
          const double computed = g.computes_before ? compute_end_[r][g.computes_before - 1] : 0;
          const double previous = at.start ? groups_[mine[at.start - 1]].end : 0;
          g.start = std::max(computed, previous);
          ++at.start;
          progress = true;
          ++resolved;
        }
      }
      if (at.end < at.start) {
        Group& g = groups_[mine[at.end]];
        if (std::all_of(g.transfers.begin(), g.transfers.end(),
                        [&](size_t t) { return transfers_[t].end != kUnknown; })) {
          g.end = g.start;
          for (size_t t : g.transfers) g.end = std::max(g.end, transfers_[t].end);
          ++at.end;
          progress = true;
          ++resolved;
        }
      }
      if (at.compute < computes_[r].size()) {
        const Action& a = computes_[r][at.compute];
        double start = at.compute ? compute_end_[r][at.compute - 1] : 0;
        bool ready = true;
        if (const auto recv = input_of(s_, r, a)) {
          const double arrived = groups_[recv_group_.at(key(r, *recv))].end;
          ready = arrived != kUnknown;
          start = std::max(start, arrived);
        }
        if (ready) {
          compute_end_[r][at.compute++] = start + cost(a, r);
          progress = true;
          ++resolved;
        }
      }
    }
    return resolved;
  }

  size_t advance_link(Link& link) {
    size_t resolved = 0;
    for (; link.next < link.transfers.size(); ++link.next, ++resolved) {
      Transfer& x = transfers_[link.transfers[link.next]];
      const double sender = groups_[x.send_group].start, receiver = groups_[x.recv_group].start;
      if (sender == kUnknown || receiver == kUnknown) break;
      const double link_free = link.next ? transfers_[link.transfers[link.next - 1]].end : 0;
      x.end = std::max({sender, receiver, link_free}) + costs_.transfer();
    }
    return resolved;
  }

  Simulation summarise() const {
    Simulation out;
    out.ranks.resize(s_.stages);
    for (int r = 0; r < s_.stages; ++r) {
      RankTimeline& tl = out.ranks[r];
      for (size_t k = 0; k < computes_[r].size(); ++k) {
        const Action& a = computes_[r][k];
        const double end = compute_end_[r][k];
        tl.compute.push_back(Span{a, end - cost(a, r), end - cost(a, r), end});
      }
      for (size_t g : groups_of_[r]) {
        const Group& group = groups_[g];
        for (const Action& a : group.messages) {
          tl.communication.push_back(Span{a, group.start, group.start, group.end});
        }
      }
      // The activations held depend only on the compute order: replay it.
      RankStateMachine held(s_, r);
      while (held.has_next()) held.complete(held.issue());
      tl.peak_stashed = held.peak_stashed();
    }
    sum_up(out, costs_, s_.chunks);
    return out;
  }

  const Schedule& s_;
  Costs costs_;
  std::vector<std::vector<Action>> computes_;
  std::vector<std::vector<double>> compute_end_;
  std::vector<Group> groups_;
  std::vector<std::vector<size_t>> groups_of_;
  std::vector<Transfer> transfers_;
  std::vector<Link> links_;
  std::vector<Cursor> cursors_;
  std::map<std::tuple<int, int, int, int>, size_t> recv_group_;
};

}  // namespace

Simulation simulate_plan(const Schedule& s, const Costs& costs,
                         const std::optional<Costs>& planned_for) {
  check_costs(costs, s.stages);
  return PlanTimer(s, costs, planned_for.value_or(costs)).run();  // post_plan validates
}

}  // namespace megart::schedule
