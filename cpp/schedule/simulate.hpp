// A discrete-event simulation of all ranks running a schedule together.
#pragma once

#include <optional>
#include <vector>

#include "schedule/schedule.hpp"

namespace megart::schedule {

struct Costs {
  // One microbatch through this rank's whole share of the model; with v chunks each chunk's
  // forward takes forward / v, so schedules of one model compare on equal work.
  double forward = 1.0;
  double backward = 2.0;
  // Share of `backward` spent on weight gradients when a schedule splits it into I and W.
  double weight_fraction = 0.5;
  double latency = 0.0;        // per message
  double bandwidth = 0.0;      // bytes per unit of time; 0 means unlimited
  double message_bytes = 0.0;  // bytes of one inter-stage tensor
  // Uneven stages: rank r's forward and backward (its whole share, as `forward` and
  // `backward`) are stage_forward[r] and stage_backward[r]; empty: the same on every rank.
  std::vector<double> stage_forward;
  std::vector<double> stage_backward;

  // Time of one compute action of rank `rank` in a schedule with `chunks` chunks per rank (0
  // for messages); rank -1: `forward` and `backward`, whatever the per-stage lists.
  double of(const Action& a, int chunks, int rank = -1) const;
  // Time of one message on its link.
  double transfer() const;
};

// Throws ConfigError for costs that are negative or not finite, or per-stage lists that are not
// empty or of `stages` entries each (stages -1: not checked).
void check_costs(const Costs& c, int stages = -1);

// One action on a timeline. Compute: issued == start, end when done. Communication: issued
// when posted, start when the transfer began (both sides posted and the link free), end when
// it arrived.
struct Span {
  Action action;
  double issued = 0;
  double start = 0;
  double end = 0;
};

struct RankTimeline {
  std::vector<Span> compute;
  std::vector<Span> communication;
  double busy = 0;       // total compute time
  int peak_stashed = 0;  // most (microbatch, chunk) activations held at once
};

struct Simulation {
  std::vector<RankTimeline> ranks;
  double makespan = 0;         // when the last rank finished, its sends included
  double ideal = 0;            // the busiest rank's compute time: the makespan with no bubble
  double bubble_fraction = 0;  // (makespan - ideal) / ideal
};

// Fills each rank's busy time and the simulation's makespan, ideal and bubble_fraction from the
// timelines' spans (busy from `costs`, exact whatever the clock's rounding); for both simulators.
void sum_up(Simulation& sim, const Costs& costs, int chunks);

// Validates, then runs every rank's state machine against the costs. Throws DeadlockError
// naming each blocked rank and what it waits on when no rank can progress.
Simulation simulate(const Schedule& s, const Costs& costs);

// Times the posting plan of `s` (post_plan.hpp, made for `planned_for`, by default for these
// costs) as NCCL runs it, not the order as written: a rank's groups run one after another, each
// once the computes posted before it have finished (its sends' tensors; the stream's order); a
// message moves once the groups at both its ends have started and its directed link has carried the
// messages before it (links in parallel); a group ends with its last message, and a compute starts
// once the group bringing its input has ended. A message's span: issued and started when its group
// started, its end the group's end. Throws DeadlockError when the plan cannot progress.
Simulation simulate_plan(const Schedule& s, const Costs& costs,
                         const std::optional<Costs>& planned_for = std::nullopt);

}  // namespace megart::schedule
