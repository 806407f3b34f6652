#include "schedule/dataflow.hpp"

namespace megart::schedule {

namespace {
Action comm(Op op, const Action& compute, int peer) {
  return Action{op, compute.microbatch, compute.chunk, peer};
}

// The neighbouring stage whose data a compute takes (upstream for F, downstream for B and I).
std::optional<Location> source(const Schedule& s, int rank, const Action& a) {
  if (a.op == Op::Forward) return s.upstream(rank, a.chunk);
  if (sends_gradient(a.op)) return s.downstream(rank, a.chunk);
  return std::nullopt;
}

// The neighbouring stage a compute's result goes to.
std::optional<Location> destination(const Schedule& s, int rank, const Action& a) {
  if (a.op == Op::Forward) return s.downstream(rank, a.chunk);
  if (sends_gradient(a.op)) return s.upstream(rank, a.chunk);
  return std::nullopt;
}
}  // namespace

std::optional<Action> input_of(const Schedule& s, int rank, const Action& a) {
  const auto from = source(s, rank, a);
  if (!from || from->rank == rank) return std::nullopt;
  return comm(a.op == Op::Forward ? Op::RecvForward : Op::RecvBackward, a, from->rank);
}

std::optional<Action> output_of(const Schedule& s, int rank, const Action& a) {
  const auto to = destination(s, rank, a);
  if (!to || to->rank == rank) return std::nullopt;
  return comm(a.op == Op::Forward ? Op::SendForward : Op::SendBackward, a, to->rank);
}

std::optional<Action> local_input_of(const Schedule& s, int rank, const Action& a) {
  const auto from = source(s, rank, a);
  if (!from || from->rank != rank) return std::nullopt;
  return Action{a.op, a.microbatch, from->chunk, -1};
}

std::optional<Message> message_of(const Schedule& s, int rank, const Action& a) {
  const bool gradient = a.op == Op::SendBackward || a.op == Op::RecvBackward;
  std::optional<Location> other;
  switch (a.op) {
    case Op::SendForward:
    case Op::RecvBackward:
      other = s.downstream(rank, a.chunk);
      break;
    case Op::RecvForward:
    case Op::SendBackward:
      other = s.upstream(rank, a.chunk);
      break;
    default:
      return std::nullopt;
  }
  if (!other || other->rank == rank) return std::nullopt;
  if (is_send(a.op)) return Message{rank, other->rank, gradient, a.microbatch, other->chunk};
  return Message{other->rank, rank, gradient, a.microbatch, a.chunk};
}

}  // namespace megart::schedule
