// One rank's schedule as a state machine: which action may run next, given what has completed.
// The simulator drives one per rank. (The pipeline engine follows post_plan.hpp instead: its
// groups must agree with its neighbours', which one rank's machine cannot see.)
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "schedule/schedule.hpp"

namespace megart::schedule {

class RankStateMachine {
 public:
  // The schedule should be valid (see validate()); the machine trusts its data flow.
  RankStateMachine(const Schedule& s, int rank);

  int rank() const { return rank_; }
  // Every action issued and completed.
  bool done() const { return next_ == actions_.size() && outstanding_ == 0; }
  bool has_next() const { return next_ < actions_.size(); }
  // The next action in order; throws ScheduleError when all are issued.
  const Action& next() const;
  // The action that must complete before next() may start (a receive, or the compute whose
  // result a send carries); empty when next() is ready. Receives are always ready to post.
  std::optional<Action> blocker() const;
  bool ready() const { return has_next() && !blocker(); }
  // Takes next(); throws ScheduleError when it is not ready.
  Action issue();
  // Marks an issued action complete; throws ScheduleError for one not issued or done twice.
  void complete(const Action& a);

  // Issued and not yet complete, in issue order.
  std::vector<Action> pending() const;
  // (microbatch, chunk) pairs whose forward has started and whose backward has not finished:
  // the activations this rank holds.
  int stashed() const { return stashed_; }
  int peak_stashed() const { return peak_stashed_; }

 private:
  enum class State : std::uint8_t { NotIssued, Issued, Done };
  size_t index(const Action& a) const;  // into states_; throws for one out of range
  bool frees_activation(const Action& a) const;

  Schedule topology_;  // stages, microbatches, chunks and forward_only: no action lists
  int rank_;
  std::vector<Action> actions_;
  size_t next_ = 0;
  int outstanding_ = 0;
  int stashed_ = 0;
  int peak_stashed_ = 0;
  bool split_backward_ = false;
  std::vector<State> states_;
};

}  // namespace megart::schedule
