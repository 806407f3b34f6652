#include "schedule/dataflow.hpp"

namespace megart::schedule {

namespace {
Action comm(Op op, const Action& compute, int peer) {
  return Action{op, compute.microbatch, compute.chunk, peer};
}
}  // namespace

std::optional<Action> input_of(const Schedule& s, int rank, const Action& a) {
  if (a.op == Op::Forward) {
    if (auto up = s.upstream(rank, a.chunk)) return comm(Op::RecvForward, a, up->rank);
  } else if (sends_gradient(a.op)) {
    if (auto down = s.downstream(rank, a.chunk)) return comm(Op::RecvBackward, a, down->rank);
  }
  return std::nullopt;
}

std::optional<Action> output_of(const Schedule& s, int rank, const Action& a) {
  if (a.op == Op::Forward) {
    if (auto down = s.downstream(rank, a.chunk)) return comm(Op::SendForward, a, down->rank);
  } else if (sends_gradient(a.op)) {
    if (auto up = s.upstream(rank, a.chunk)) return comm(Op::SendBackward, a, up->rank);
  }
  return std::nullopt;
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
  if (!other) return std::nullopt;
  if (is_send(a.op)) return Message{rank, other->rank, gradient, a.microbatch, other->chunk};
  return Message{other->rank, rank, gradient, a.microbatch, a.chunk};
}

}  // namespace megart::schedule
