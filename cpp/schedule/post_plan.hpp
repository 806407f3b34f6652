// When each pipeline rank posts its messages, and which go together, so that every transport can
// run a schedule: NCCL's included.
//
// NCCL matches two ranks' point-to-point calls in order, and only when both ranks group them
// alike: the ops between a pair of ranks must fall into the same groups (ncclGroupStart/End) on
// both sides. Anything else is undefined (NVIDIA/nccl#1279); on an H200 it failed with "Message
// truncated" when one rank posted [send F0, recv B0] together and its neighbour [recv F0] alone.
// NCCL also runs a communicator's groups one after another, in posting order, so the order must
// leave no cycle of waits between ranks.
//
// A schedule gives each rank an order written for that rank alone; the plan groups its messages
// by when the schedule, played as written, would start them: the simulator (simulate.hpp) runs
// every rank with the expected costs (by default F = 1, B = 2, I = W = 1, messages free), each
// message starting once both ends have posted it and its link is free. The messages a rank starts
// at the same moment (to rounding: 1e-9 of the makespan) form one group, and every rank posts its
// groups in the order of those moments, each right after the compute that made its last send (and
// after the rank's previous group), so a send leaves as soon as its tensor exists.
//
// A message's two ends start at the same moment, so both ranks of a pair group their messages
// alike; every rank posts in the order of the moments, and every wait points to an earlier moment
// (every compute cost is positive: a compute that needs a message starts after that message's
// moment, and a send's moment comes after the compute that makes it), so no group waits on a
// later one. The first version grouped by rounds of one compute per rank; its sends waited for
// their rank's later messages, and an interleaved iteration at p = 8, m = 32 took 1.375 times its
// compute time instead of 1.109 (simulate_plan, free communication).
//
// Plans are made for the messages' costs too. NCCL runs a rank's groups one after another, so
// two messages the schedule overlaps but starts at different moments wait for each other, and
// where messages take time their moments move. Figures from simulate_plan over the built-in kinds
// (bench/pipeline_plan.py: p 2-8, m p to 4p), as a ratio to the schedule as written with its
// messages overlapping freely:
// - run with the costs the plan was made for: 1.000 with messages free (the plan keeps the
//   schedule's bubble) and with each message up to a fifth of a chunk's forward; a plan made for
//   free messages takes up to 1.104 at a fifth.
// - made for costly messages (up to a chunk's forward each), run with free ones: as written for
//   every kind but zb-v in 3,000 random cases of costs; zb-v up to 1.035. A message exactly as
//   long as a chunk's forward is the exception found: messages of different steps then start at
//   the same moment and join one group, and an interleaved forward-only pass took 1.154.
// - made for the run's costs in those cases: up to 1.082, and up to 1.269 if made for free
//   messages; the first faster in 1,922 cases, slower in 68 (by up to 3.7%).
#pragma once

#include <optional>
#include <vector>

#include "schedule/schedule.hpp"
#include "schedule/simulate.hpp"

namespace megart::schedule {

// One thing a rank does, in its order: run a compute (`compute`), or post communication actions
// as one group (`post`, in the schedule's order).
struct Step {
  std::optional<Action> compute;
  std::vector<Action> post;
};

// Every rank's steps for a valid schedule, planned for `costs` (computes and messages; every rank
// must plan with the same costs, so that the groups agree without a message). Throws ScheduleError
// for an invalid schedule, DeadlockError for one no blocking transport can run, ConfigError for a
// cost that is not positive.
std::vector<std::vector<Step>> post_plan(const Schedule& s, const Costs& costs = Costs{});

}  // namespace megart::schedule
