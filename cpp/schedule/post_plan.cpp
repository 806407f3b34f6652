#include "schedule/post_plan.hpp"

#include <algorithm>
#include <map>
#include <utility>
#include <vector>

#include "common/error.hpp"
#include "schedule/simulate.hpp"

namespace megart::schedule {

std::vector<std::vector<Step>> post_plan(const Schedule& s, const Costs& costs) {
  // Every compute must take time, or a group could wait on a compute that waits on it.
  if (!(costs.forward > 0 && costs.backward > 0 && costs.weight_fraction > 0 &&
        costs.weight_fraction < 1)) {
    throw ConfigError(
        "a posting plan needs forward and backward costs above 0 and a weight_fraction "
        "strictly between 0 and 1");
  }
  // Played with its messages' costs too: where messages take time, the moments they start shift,
  // and grouping by the shifted moments keeps a rank from waiting on a group of its messages
  // that the schedule would have overlapped with another (see the header's figures).
  const Simulation as_written = simulate(s, costs);  // validates; throws for a deadlock
  std::vector<std::vector<Step>> plan(s.stages);
  for (int r = 0; r < s.stages; ++r) {
    // The rank's computes, and its messages by start, each with the computes before it in the
    // rank's order. The simulator issues a rank's messages in that order: span k is message k.
    std::vector<Action> computes;
    std::map<double, std::vector<std::pair<size_t, Action>>> by_start;
    const std::vector<Span>& spans = as_written.ranks[r].communication;
    size_t message = 0;
    for (const Action& a : s.ranks[r]) {
      if (is_compute(a.op)) {
        computes.push_back(a);
      } else {
        by_start[spans.at(message++).start].emplace_back(computes.size(), a);
      }
    }
    std::vector<Step>& steps = plan[r];
    size_t taken = 0;  // computes placed so far
    for (auto& [start, messages] : by_start) {
      Step group;
      size_t after = taken;
      for (auto& [before, a] : messages) {
        after = std::max(after, before);
        group.post.push_back(a);
      }
      for (; taken < after; ++taken) steps.push_back(Step{computes[taken], {}});
      steps.push_back(std::move(group));
    }
    for (; taken < computes.size(); ++taken) steps.push_back(Step{computes[taken], {}});
  }
  return plan;
}

}  // namespace megart::schedule
