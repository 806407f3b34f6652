// A pipeline schedule is data: for each rank, the ordered list of actions it performs for one
// training iteration. Everything else (validation, simulation, execution) reads this structure.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "schedule/action.hpp"

namespace megart::schedule {

enum class Kind {
  GPipe,         // all forwards, then all backwards
  OneFOneB,      // PipeDream-Flush: warm-up forwards, one forward / one backward, cool-down
  Interleaved,   // Megatron's interleaved 1F1B: v model chunks per rank
  ZeroBubbleH1,  // "zb-h1": 1F1B with backwards split into I and W, some W deferred
  ZeroBubbleV,   // "zb-v": two chunks per rank placed in a V (see virtual_stage), split backward
  Custom,        // compute orders given by the caller (tests, experiments, future kinds)
};

// "gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "custom"
const char* kind_name(Kind kind);
Kind kind_from_name(const std::string& name);
// Whether the kind splits every backward into I and W.
bool splits_backward(Kind kind);

// Where a (rank, chunk) sits in the model. Chunk c of rank r is virtual stage c * stages + r
// (Megatron's looping placement), so activations flow r -> r+1 and wrap from the last rank to
// rank 0 between chunks. zb-v places its two chunks in a V instead: chunk 0 of rank r is stage
// r and chunk 1 is stage 2p-1-r, so the last stage shares rank 0 with the first and the turn
// between stages p-1 and p stays on rank p-1 (no message).
struct Location {
  int rank;
  int chunk;
};

struct Schedule {
  Kind kind = Kind::Custom;
  int stages = 1;                          // p: pipeline ranks
  int microbatches = 1;                    // m
  int chunks = 1;                          // v: model chunks per rank
  std::vector<std::vector<Action>> ranks;  // ranks[r]: rank r's actions in order
  // An evaluation pass: forwards and their messages only (see forward_only() below).
  bool forward_only = false;

  int num_virtual_stages() const { return stages * chunks; }
  int virtual_stage(int rank, int chunk) const {
    if (kind == Kind::ZeroBubbleV) return chunk == 0 ? rank : 2 * stages - 1 - rank;
    return chunk * stages + rank;
  }
  Location location(int virtual_stage) const {
    if (kind == Kind::ZeroBubbleV) {
      return virtual_stage < stages ? Location{virtual_stage, 0}
                                    : Location{2 * stages - 1 - virtual_stage, 1};
    }
    return {virtual_stage % stages, virtual_stage / stages};
  }
  // Where this (rank, chunk)'s forward input comes from; empty on the first virtual stage.
  std::optional<Location> upstream(int rank, int chunk) const;
  // Where this (rank, chunk)'s forward output goes; empty on the last virtual stage.
  std::optional<Location> downstream(int rank, int chunk) const;
};

// Checks (kind, stages, microbatches, chunks) and throws ConfigError naming the rule broken and
// the values that would fit.
void check_arguments(Kind kind, int stages, int microbatches, int chunks);

// The compute actions (F and B) of each rank, in order, for a named kind.
std::vector<std::vector<Action>> compute_orders(Kind kind, int stages, int microbatches,
                                                int chunks);

// Adds the communication to per-rank compute orders. A send follows the compute that produced
// its data. A receive is posted one compute ahead of the compute that needs it (so the transfer
// overlaps that compute), or earlier where the messages between two ranks must stay in the
// sender's order (NCCL matches sends and receives between a pair in the order they are posted).
Schedule with_communication(Kind kind, int stages, int microbatches, int chunks,
                            const std::vector<std::vector<Action>>& compute);

// The full schedule of a named kind.
Schedule build(Kind kind, int stages, int microbatches, int chunks = 1);

// The same schedule for an evaluation pass, as Megatron's forward_only: every backward and
// gradient message removed, forwards and their messages kept in their order. A forward waits
// only on forwards upstream, so what was deadlock-free stays so, and each pair of ranks still
// posts its remaining messages in the sender's order.
Schedule forward_only(const Schedule& s);

// Bubble time over ideal time: (p-1)/m for GPipe and 1F1B, (p-1)/(v*m) for interleaved. For
// the zero-bubble kinds, with equal F, I and W times (the default simulator costs) and free
// communication: (p-1)/(3m) for zb-h1 and (p-1)/(6m) for zb-v.
double theoretical_bubble(Kind kind, int stages, int microbatches, int chunks = 1);

}  // namespace megart::schedule
