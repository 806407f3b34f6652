#include "schedule/post_plan.hpp"

#include <algorithm>
#include <deque>
#include <map>
#include <string>
#include <utility>

#include "common/error.hpp"
#include "schedule/dataflow.hpp"
#include "schedule/validate.hpp"

namespace megart::schedule {

namespace {

// A communication action waiting to be posted, with the number of its rank's computes that ran
// before it (the earliest place its group may go).
struct Pending {
  int anchor = 0;
  Action action;
};

// A rank's progress through its schedule while the plan is played.
struct RankPlay {
  const std::vector<Action>* todo = nullptr;
  size_t position = 0;
  std::vector<Action> computes;
  std::vector<std::pair<int, std::vector<Action>>> groups;  // (anchor, ops)
  std::vector<Pending> pending;
  std::vector<bool> received;  // by (gradient?, microbatch, chunk)

  bool finished() const { return position == todo->size() && pending.empty(); }
};

size_t received_index(const Schedule& s, bool gradient, int microbatch, int chunk) {
  return (static_cast<size_t>(gradient) * s.microbatches + microbatch) * s.chunks + chunk;
}

// Runs rank r's next compute if its input is there, passing the messages before and after it
// (they become pending); true if a compute ran.
bool advance(const Schedule& s, int r, RankPlay& play) {
  bool ran = false;
  for (; play.position < play.todo->size(); ++play.position) {
    const Action& a = (*play.todo)[play.position];
    if (!is_compute(a.op)) {
      play.pending.push_back({static_cast<int>(play.computes.size()), a});
      continue;
    }
    if (ran) return true;
    if (const auto need = input_of(s, r, a)) {
      if (!play.received[received_index(s, need->op == Op::RecvBackward, need->microbatch,
                                        need->chunk)]) {
        return false;
      }
    }
    play.computes.push_back(a);
    ran = true;
  }
  return ran;
}

std::vector<Step> merge(const RankPlay& play) {
  std::vector<Step> steps;
  size_t g = 0;
  for (size_t n = 0; n <= play.computes.size(); ++n) {
    for (; g < play.groups.size() && play.groups[g].first == static_cast<int>(n); ++g) {
      steps.push_back(Step{std::nullopt, play.groups[g].second});
    }
    if (n < play.computes.size()) steps.push_back(Step{play.computes[n], {}});
  }
  return steps;
}

std::string stuck_ranks(const std::vector<RankPlay>& plays) {
  std::string out;
  for (size_t r = 0; r < plays.size(); ++r) {
    if (plays[r].pending.empty()) continue;
    out += (out.empty() ? "rank " : "; rank ") + std::to_string(r) + ":";
    for (const Pending& p : plays[r].pending) out += " " + to_string(p.action);
  }
  return out;
}

}  // namespace

std::vector<std::vector<Step>> post_plan(const Schedule& s) {
  validate(s);  // every index below is in range, every message has its partner
  const int p = s.stages;
  std::vector<RankPlay> plays(p);
  for (int r = 0; r < p; ++r) {
    plays[r].todo = &s.ranks[r];
    plays[r].received.assign(2 * static_cast<size_t>(s.microbatches) * s.chunks, false);
  }
  while (true) {
    bool any_ran = false;
    for (int r = 0; r < p; ++r) any_ran |= advance(s, r, plays[r]);
    if (std::all_of(plays.begin(), plays.end(), [](const RankPlay& pl) { return pl.finished(); })) {
      break;
    }
    // Pending ops by direction, in each rank's order: the k-th send from a to b meets the k-th
    // receive on b from a. `going[r]` collects indices into plays[r].pending.
    std::map<std::pair<int, int>, std::pair<std::vector<size_t>, std::vector<size_t>>> directions;
    for (int r = 0; r < p; ++r) {
      for (size_t i = 0; i < plays[r].pending.size(); ++i) {
        const Action& a = plays[r].pending[i].action;
        if (is_send(a.op)) {
          directions[{r, a.peer}].first.push_back(i);
        } else {
          directions[{a.peer, r}].second.push_back(i);
        }
      }
    }
    std::vector<std::vector<bool>> going(p);
    for (int r = 0; r < p; ++r) going[r].assign(plays[r].pending.size(), false);
    bool any_posted = false;
    for (const auto& [direction, ops] : directions) {
      const auto [src, dst] = direction;
      const size_t pairs = std::min(ops.first.size(), ops.second.size());
      for (size_t k = 0; k < pairs; ++k) {
        const Action& out = plays[src].pending[ops.first[k]].action;
        const Action& into = plays[dst].pending[ops.second[k]].action;
        // validate() checked this pairing; a slip here would post a wrong plan silently.
        if ((out.op == Op::SendBackward) != (into.op == Op::RecvBackward) ||
            out.microbatch != into.microbatch) {
          throw ScheduleError("the schedule's messages from rank " + std::to_string(src) +
                              " to rank " + std::to_string(dst) + " do not pair in order: " +
                              to_string(out) + " meets " + to_string(into));
        }
        going[src][ops.first[k]] = going[dst][ops.second[k]] = true;
        any_posted = true;
      }
    }
    if (!any_posted && !any_ran) {
      throw DeadlockError(
          "the schedule cannot make progress: every rank waits for a message no rank posts "
          "(pending per rank: " +
          stuck_ranks(plays) + ")");
    }
    for (int r = 0; r < p; ++r) {
      RankPlay& play = plays[r];
      std::vector<Action> group;
      std::vector<Pending> left;
      int anchor = play.groups.empty() ? 0 : play.groups.back().first;
      for (size_t i = 0; i < play.pending.size(); ++i) {
        const Pending& op = play.pending[i];
        if (!going[r][i]) {
          left.push_back(op);
          continue;
        }
        group.push_back(op.action);
        anchor = std::max(anchor, op.anchor);
        if (is_recv(op.action.op)) {
          play.received[received_index(s, op.action.op == Op::RecvBackward, op.action.microbatch,
                                       op.action.chunk)] = true;
        }
      }
      if (group.empty()) continue;
      play.groups.emplace_back(anchor, std::move(group));
      play.pending = std::move(left);
    }
  }
  std::vector<std::vector<Step>> steps;
  steps.reserve(p);
  for (const RankPlay& play : plays) steps.push_back(merge(play));
  return steps;
}

}  // namespace megart::schedule
