// Which data each action moves: the one place that knows that a forward needs an activation from
// the previous virtual stage and a backward needs a gradient from the next one.
#pragma once

#include <optional>

#include "schedule/schedule.hpp"

namespace megart::schedule {

// A message between two ranks, named by what the receiver does with it.
struct Message {
  int src = 0;
  int dst = 0;
  bool gradient = false;  // false: forward activation, true: backward gradient
  int microbatch = 0;
  int dst_chunk = 0;

  bool operator==(const Message& o) const {
    return src == o.src && dst == o.dst && gradient == o.gradient && microbatch == o.microbatch &&
           dst_chunk == o.dst_chunk;
  }
};

// The receive a compute action on `rank` must wait for (empty on the first virtual stage for F,
// the last for B and I, and always for W).
std::optional<Action> input_of(const Schedule& s, int rank, const Action& compute);

// The send that carries a compute action's result onward (empty where nothing leaves the rank).
std::optional<Action> output_of(const Schedule& s, int rank, const Action& compute);

// The compute on the same rank whose result a compute action takes without a message: where two
// neighbouring virtual stages share a rank (zb-v's turn on rank p-1), F of the later chunk takes
// F of the earlier one's output, and the earlier chunk's B or I takes the later one's gradient.
std::optional<Action> local_input_of(const Schedule& s, int rank, const Action& compute);

// The message a communication action on `rank` carries; empty when the action points nowhere
// (a receive on the first virtual stage, say). Peers come from the placement, not `action.peer`.
std::optional<Message> message_of(const Schedule& s, int rank, const Action& action);

}  // namespace megart::schedule
