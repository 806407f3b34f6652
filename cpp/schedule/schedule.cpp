// The named kinds: argument rules, compute orders and their theoretical bubbles.
#include "schedule/schedule.hpp"

#include <algorithm>
#include <sstream>

#include "common/error.hpp"

namespace megart::schedule {

const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::GPipe:
      return "gpipe";
    case Kind::OneFOneB:
      return "1f1b";
    case Kind::Interleaved:
      return "interleaved";
    case Kind::Custom:
      return "custom";
  }
  return "?";
}

Kind kind_from_name(const std::string& name) {
  for (Kind k : {Kind::GPipe, Kind::OneFOneB, Kind::Interleaved, Kind::Custom}) {
    if (name == kind_name(k)) return k;
  }
  throw ConfigError("unknown schedule kind '" + name +
                    "'; expected one of gpipe, 1f1b, interleaved");
}

std::optional<Location> Schedule::upstream(int rank, int chunk) const {
  const int vs = virtual_stage(rank, chunk);
  if (vs == 0) return std::nullopt;
  return location(vs - 1);
}

std::optional<Location> Schedule::downstream(int rank, int chunk) const {
  const int vs = virtual_stage(rank, chunk);
  if (vs + 1 == num_virtual_stages()) return std::nullopt;
  return location(vs + 1);
}

void check_arguments(Kind kind, int stages, int microbatches, int chunks) {
  std::ostringstream msg;
  if (stages < 1) {
    msg << "the number of pipeline stages must be at least 1 (got " << stages << ")";
  } else if (microbatches < 1) {
    msg << "the number of microbatches must be at least 1 (got " << microbatches << ")";
  } else if (chunks < 1) {
    msg << "the number of model chunks per rank must be at least 1 (got " << chunks << ")";
  } else if (kind != Kind::Interleaved && kind != Kind::Custom && chunks != 1) {
    msg << "the " << kind_name(kind)
        << " schedule runs one model chunk per rank (got chunks=" << chunks
        << "); use the interleaved schedule for several chunks";
  } else if (kind == Kind::Interleaved && stages < 2) {
    msg << "the interleaved schedule needs at least 2 pipeline stages (got " << stages
        << "); with one stage use 1f1b";
  } else if (kind == Kind::Interleaved && microbatches % stages != 0) {
    const int below = microbatches / stages * stages;
    msg << "the interleaved schedule needs the number of microbatches (" << microbatches
        << ") to be a multiple of the pipeline size (" << stages << "); use ";
    if (below > 0) msg << below << " or ";
    msg << below + stages << " microbatches";
  } else {
    return;
  }
  throw ConfigError(msg.str());
}

namespace {

Action compute(Op op, int microbatch, int chunk) { return Action{op, microbatch, chunk, -1}; }

std::vector<Action> gpipe(int microbatches) {
  std::vector<Action> order;
  for (int mb = 0; mb < microbatches; ++mb) order.push_back(compute(Op::Forward, mb, 0));
  for (int mb = 0; mb < microbatches; ++mb) order.push_back(compute(Op::Backward, mb, 0));
  return order;
}

// Warm-up forwards, then alternate one forward and one backward, then the remaining backwards.
// forward(k) and backward(k) name the k-th forward and backward step of this rank.
template <typename StepF, typename StepB>
std::vector<Action> one_forward_one_backward(int steps, int warmup, StepF forward, StepB backward) {
  std::vector<Action> order;
  for (int k = 0; k < warmup; ++k) order.push_back(forward(k));
  for (int i = 0; i < steps - warmup; ++i) {
    order.push_back(forward(warmup + i));
    order.push_back(backward(i));
  }
  for (int k = steps - warmup; k < steps; ++k) order.push_back(backward(k));
  return order;
}

std::vector<Action> one_f_one_b(int stages, int microbatches, int rank) {
  // Rank r runs p - r - 1 forwards ahead, so at most p - r microbatches are ever in flight.
  const int warmup = std::min(stages - rank - 1, microbatches);
  return one_forward_one_backward(
      microbatches, warmup, [](int k) { return compute(Op::Forward, k, 0); },
      [](int k) { return compute(Op::Backward, k, 0); });
}

std::vector<Action> interleaved(int stages, int microbatches, int chunks, int rank) {
  // Megatron's order: steps go through p microbatches on one chunk before moving to the next
  // chunk; backwards visit the chunks in reverse.
  const int group = stages * chunks;
  auto microbatch = [&](int k) { return k / group * stages + k % stages; };
  auto chunk = [&](int k) { return k % group / stages; };
  const int steps = microbatches * chunks;
  const int warmup = std::min((stages - rank - 1) * 2 + (chunks - 1) * stages, steps);
  return one_forward_one_backward(
      steps, warmup, [&](int k) { return compute(Op::Forward, microbatch(k), chunk(k)); },
      [&](int k) { return compute(Op::Backward, microbatch(k), chunks - 1 - chunk(k)); });
}

}  // namespace

std::vector<std::vector<Action>> compute_orders(Kind kind, int stages, int microbatches,
                                                int chunks) {
  check_arguments(kind, stages, microbatches, chunks);
  std::vector<std::vector<Action>> orders;
  for (int rank = 0; rank < stages; ++rank) {
    switch (kind) {
      case Kind::GPipe:
        orders.push_back(gpipe(microbatches));
        break;
      case Kind::OneFOneB:
        orders.push_back(one_f_one_b(stages, microbatches, rank));
        break;
      case Kind::Interleaved:
        orders.push_back(interleaved(stages, microbatches, chunks, rank));
        break;
      case Kind::Custom:
        throw ConfigError("a custom schedule has no built-in order; pass its compute orders");
    }
  }
  return orders;
}

Schedule build(Kind kind, int stages, int microbatches, int chunks) {
  return with_communication(kind, stages, microbatches, chunks,
                            compute_orders(kind, stages, microbatches, chunks));
}

double theoretical_bubble(Kind kind, int stages, int microbatches, int chunks) {
  check_arguments(kind, stages, microbatches, chunks);
  const double v = kind == Kind::Interleaved ? chunks : 1;
  return (stages - 1) / (v * microbatches);
}

Schedule forward_only(const Schedule& s) {
  Schedule out = s;
  out.forward_only = true;
  for (auto& actions : out.ranks) {
    actions.erase(std::remove_if(actions.begin(), actions.end(),
                                 [](const Action& a) {
                                   return a.op != Op::Forward && a.op != Op::SendForward &&
                                          a.op != Op::RecvForward;
                                 }),
                  actions.end());
  }
  return out;
}

}  // namespace megart::schedule
