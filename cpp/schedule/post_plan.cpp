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
    // Moments equal in exact arithmetic but reached by different sums of costs can differ in
    // their last bits; left apart, they would split a group at random microbatches of a long
    // schedule. Starts within a rounding tolerance of a group's first are one group: the
    // schedule's distinct moments lie at least one compute (far more) apart.
    const double tolerance = 1e-9 * as_written.makespan;
    std::vector<std::pair<double, std::vector<std::pair<size_t, Action>>>> groups;
    for (auto& [start, messages] : by_start) {
      if (groups.empty() || start - groups.back().first > tolerance) {
        groups.emplace_back(start, std::move(messages));
      } else {
        auto& joined = groups.back().second;
        joined.insert(joined.end(), messages.begin(), messages.end());
        // By the computes before them, the rank's order within one start.
        std::stable_sort(joined.begin(), joined.end(),
                         [](const auto& a, const auto& b) { return a.first < b.first; });
      }
    }
    std::vector<Step>& steps = plan[r];
    size_t taken = 0;  // computes placed so far
    for (auto& [start, messages] : groups) {
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
