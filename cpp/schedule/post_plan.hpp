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
// every rank with the computes' expected costs (by default F = 1, B = 2, I = W = 1; the
// communication free), each message starting once both ends have posted it. The messages a rank
// starts at the same moment form one group, and every rank posts its groups in the order of those
// moments, each right after the compute that made its last send (and after the rank's previous
// group), so a send leaves as soon as its tensor exists.
//
// A message's two ends start at the same moment, so both ranks of a pair group their messages
// alike; every rank posts in the order of the moments, and every wait points to an earlier moment
// (every cost is positive: a compute that needs a message starts after that message's moment, and
// a send's moment comes after the compute that makes it), so no group waits on a later one. Where
// the computes take the costs it was planned with, the plan starts every message when the
// schedule as written would, so it keeps the schedule's bubble (with other costs a group's
// messages may wait for each other). The first version grouped by rounds of one compute per rank;
// its sends waited for their rank's later messages, and an interleaved iteration at p = 8, m = 32
// took 1.375 times its compute time instead of 1.109 (simulate_plan, free communication).
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

// Every rank's steps for a valid schedule, planned for the computes' costs in `costs` (its
// communication costs are ignored; every rank must plan with the same costs, so that the groups
// agree without a message). Throws ScheduleError for an invalid schedule, DeadlockError for one
// no blocking transport can run, ConfigError for a cost that is not positive.
std::vector<std::vector<Step>> post_plan(const Schedule& s, const Costs& costs = Costs{});

}  // namespace megart::schedule
