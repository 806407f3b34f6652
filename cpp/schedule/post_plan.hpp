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
// A schedule gives each rank an order written for that rank alone. The plan plays all ranks'
// schedules forward together in rounds:
// 1. each rank runs its next compute if its input is there (a message received in an earlier
//    round, or a hand-over from a chunk on the same rank); the communication actions it passes
//    on the way become pending;
// 2. every pending op whose partner (the op on the other rank, paired first-in first-out per
//    direction, as NCCL pairs them) is pending too goes in this round; each rank's share of a
//    round is one group.
// One compute per rank per round keeps groups as small as the schedule's own batches, so a
// transfer waits for nothing but its partner. A group is placed in its rank's order right after
// the compute that made its last send (and after the rank's previous group), not where the
// rounds found it, so a send leaves as soon as its tensor exists.
//
// Both ranks of a pair put the same ops in a round's groups by construction, and every rank posts
// its groups in round order, so round numbers order all groups of all ranks: nothing waits on a
// later round. Every transport runs the same plan, so the CPU runs test the GPU's grouping.
#pragma once

#include <optional>
#include <vector>

#include "schedule/schedule.hpp"

namespace megart::schedule {

// One thing a rank does, in its order: run a compute (`compute`), or post communication actions
// as one group (`post`, in the schedule's order).
struct Step {
  std::optional<Action> compute;
  std::vector<Action> post;
};

// Every rank's steps for a valid schedule (every rank computes the same plan, so the groups agree
// without a message). Throws ScheduleError when the messages between two ranks do not pair in
// order, or when no rank can progress (a schedule no blocking transport can run).
std::vector<std::vector<Step>> post_plan(const Schedule& s);

}  // namespace megart::schedule
