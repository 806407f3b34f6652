#include "schedule/state_machine.hpp"

#include <algorithm>
#include <string>

#include "common/error.hpp"
#include "schedule/dataflow.hpp"

namespace megart::schedule {

RankStateMachine::RankStateMachine(const Schedule& s, int rank)
    : topology_{s.kind, s.stages, s.microbatches, s.chunks, {}, s.forward_only}, rank_(rank) {
  if (rank < 0 || rank >= s.stages || static_cast<int>(s.ranks.size()) != s.stages) {
    throw ConfigError("rank " + std::to_string(rank) + " is not a rank of this " +
                      std::to_string(s.stages) + "-stage schedule");
  }
  actions_ = s.ranks[rank];
  states_.assign(static_cast<size_t>(kNumOps) * s.microbatches * s.chunks, State::NotIssued);
  split_backward_ = std::any_of(actions_.begin(), actions_.end(),
                                [](const Action& a) { return a.op == Op::BackwardWeight; });
}

size_t RankStateMachine::index(const Action& a) const {
  if (a.microbatch < 0 || a.microbatch >= topology_.microbatches || a.chunk < 0 ||
      a.chunk >= topology_.chunks) {
    throw ScheduleError("rank " + std::to_string(rank_) + ": " + to_string(a) +
                        " is out of range for this schedule");
  }
  return (static_cast<size_t>(a.op) * topology_.microbatches + a.microbatch) * topology_.chunks +
         a.chunk;
}

const Action& RankStateMachine::next() const {
  if (!has_next()) {
    throw ScheduleError("rank " + std::to_string(rank_) + " has issued all its actions");
  }
  return actions_[next_];
}

std::optional<Action> RankStateMachine::blocker() const {
  const Action& a = next();
  auto unfinished = [&](const Action& dep) -> std::optional<Action> {
    if (states_[index(dep)] == State::Done) return std::nullopt;
    return dep;
  };
  switch (a.op) {
    case Op::Forward:
      if (auto recv = input_of(topology_, rank_, a)) return unfinished(*recv);
      if (auto local = local_input_of(topology_, rank_, a)) return unfinished(*local);
      return std::nullopt;
    case Op::Backward:
    case Op::BackwardInput: {
      if (auto f = unfinished(Action{Op::Forward, a.microbatch, a.chunk, -1})) return f;
      if (auto recv = input_of(topology_, rank_, a)) return unfinished(*recv);
      if (auto local = local_input_of(topology_, rank_, a)) return unfinished(*local);
      return std::nullopt;
    }
    case Op::BackwardWeight:
      return unfinished(Action{Op::BackwardInput, a.microbatch, a.chunk, -1});
    case Op::SendForward:
      return unfinished(Action{Op::Forward, a.microbatch, a.chunk, -1});
    case Op::SendBackward: {
      const Op producer = split_backward_ ? Op::BackwardInput : Op::Backward;
      return unfinished(Action{producer, a.microbatch, a.chunk, -1});
    }
    case Op::RecvForward:
    case Op::RecvBackward:
      return std::nullopt;
  }
  return std::nullopt;
}

Action RankStateMachine::issue() {
  const Action a = next();
  if (auto dep = blocker()) {
    throw ScheduleError("rank " + std::to_string(rank_) + ": " + to_string(a) +
                        " is not ready: it waits for " + to_string(*dep));
  }
  State& st = states_[index(a)];
  if (st != State::NotIssued) {
    throw ScheduleError("rank " + std::to_string(rank_) + ": " + to_string(a) + " is issued twice");
  }
  st = State::Issued;
  ++next_;
  ++outstanding_;
  if (a.op == Op::Forward) peak_stashed_ = std::max(peak_stashed_, ++stashed_);
  return a;
}

bool RankStateMachine::frees_activation(const Action& a) const {
  if (topology_.forward_only) return a.op == Op::Forward;  // nothing is kept for a backward
  return a.op == (split_backward_ ? Op::BackwardWeight : Op::Backward);
}

void RankStateMachine::complete(const Action& a) {
  State& st = states_[index(a)];
  if (st != State::Issued) {
    throw ScheduleError("rank " + std::to_string(rank_) + ": " + to_string(a) + " completed " +
                        (st == State::Done ? "twice" : "before it was issued"));
  }
  st = State::Done;
  --outstanding_;
  if (frees_activation(a)) --stashed_;
}

std::vector<Action> RankStateMachine::pending() const {
  std::vector<Action> out;
  for (size_t i = 0; i < next_; ++i) {
    if (states_[index(actions_[i])] == State::Issued) out.push_back(actions_[i]);
  }
  return out;
}

}  // namespace megart::schedule
