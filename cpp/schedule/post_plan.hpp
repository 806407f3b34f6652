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
// alike; every rank posts in the order of the moments, so no group waits on a later one (every
// cost is positive: a compute starts strictly after the messages it needs, and ends strictly
// before the sends it makes). Where the computes take the costs it was planned with, the plan
// starts every message when the schedule as written would, so it keeps the schedule's bubble
// (with other costs, a group's messages may wait for each other); grouping by rounds of
// one compute per rank (the first version) coupled a rank's sends to its neighbours' progress
// and lost up to a quarter of an interleaved iteration (simulate_plan, p = 8).
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
