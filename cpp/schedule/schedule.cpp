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
    case Kind::ZeroBubbleH1:
      return "zb-h1";
    case Kind::ZeroBubbleV:
      return "zb-v";
    case Kind::Custom:
      return "custom";
  }
  return "?";
}

bool splits_backward(Kind kind) { return kind == Kind::ZeroBubbleH1 || kind == Kind::ZeroBubbleV; }

Kind kind_from_name(const std::string& name) {
  for (Kind k : {Kind::GPipe, Kind::OneFOneB, Kind::Interleaved, Kind::ZeroBubbleH1,
                 Kind::ZeroBubbleV, Kind::Custom}) {
    if (name == kind_name(k)) return k;
  }
  throw ConfigError("unknown schedule kind '" + name +
                    "'; expected one of gpipe, 1f1b, interleaved, zb-h1, zb-v");
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
  } else if (kind == Kind::ZeroBubbleV && chunks != 2) {
    msg << "the zb-v schedule runs exactly 2 model chunks per rank, placed in a V (got chunks="
        << chunks << ")";
  } else if (kind == Kind::ZeroBubbleV && microbatches < 2 * stages) {
    msg << "the zb-v schedule needs at least twice as many microbatches as pipeline stages ("
        << microbatches << " < 2 x " << stages << "); use " << 2 * stages
        << " or more microbatches, or zb-h1";
  } else if (kind != Kind::Interleaved && kind != Kind::ZeroBubbleV && kind != Kind::Custom &&
             chunks != 1) {
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

// 1F1B's order with each B split into I and W: W's of the first `rank` steps wait, and each
// later I is followed by the W of the oldest microbatch not yet done. The r deferred W's run
// at the end, where 1F1B's rank r would idle, and F-to-W stays at p microbatches on every rank.
std::vector<Action> zero_bubble_h1(int stages, int microbatches, int rank) {
  const int warmup = std::min(stages - rank - 1, microbatches);
  std::vector<Action> order;
  int next_f = 0, next_w = 0;
  for (; next_f < warmup; ++next_f) order.push_back(compute(Op::Forward, next_f, 0));
  for (int i = 0; i < microbatches; ++i) {
    if (next_f < microbatches) order.push_back(compute(Op::Forward, next_f++, 0));
    order.push_back(compute(Op::BackwardInput, i, 0));
    if (i >= rank) order.push_back(compute(Op::BackwardWeight, next_w++, 0));
  }
  for (; next_w < microbatches; ++next_w) order.push_back(compute(Op::BackwardWeight, next_w, 0));
  return order;
}

// The V schedule with two chunks per rank (stage r and stage 2p-1-r). Warm-up: 2(p-r)-1
// forwards of chunk 0, r pairs (F chunk 1, F chunk 0), then p-r rounds of F, I, W on chunk 1.
// Steady state: F, I, W on chunk 0 then on chunk 1. Cool-down: r rounds of I on both chunks,
// p-r rounds of I and W on chunk 0, then the W's left, chunk 1's first.
std::vector<Action> zero_bubble_v(int stages, int microbatches, int rank) {
  std::vector<Action> order;
  int f[2] = {0, 0}, i[2] = {0, 0}, w[2] = {0, 0};
  auto F = [&](int c) { order.push_back(compute(Op::Forward, f[c]++, c)); };
  auto I = [&](int c) { order.push_back(compute(Op::BackwardInput, i[c]++, c)); };
  auto W = [&](int c) { order.push_back(compute(Op::BackwardWeight, w[c]++, c)); };
  for (int k = 0; k < 2 * (stages - rank) - 1; ++k) F(0);
  for (int k = 0; k < rank; ++k) F(1), F(0);
  for (int k = 0; k < stages - rank; ++k) F(1), I(1), W(1);
  while (f[1] < f[0] || f[0] < microbatches) {
    if (f[0] < microbatches) F(0);
    I(0), W(0), F(1), I(1), W(1);
  }
  for (int k = 0; k < rank; ++k) I(0), I(1);
  for (int k = 0; k < stages - rank; ++k) I(0), W(0);
  while (w[1] < microbatches) W(1);
  while (w[0] < microbatches) W(0);
  return order;
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
      case Kind::ZeroBubbleH1:
        orders.push_back(zero_bubble_h1(stages, microbatches, rank));
        break;
      case Kind::ZeroBubbleV:
        orders.push_back(zero_bubble_v(stages, microbatches, rank));
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
  if (kind == Kind::ZeroBubbleH1) return (stages - 1) / (3.0 * microbatches);
  if (kind == Kind::ZeroBubbleV) return (stages - 1) / (6.0 * microbatches);
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
