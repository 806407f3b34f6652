// The vocabulary of pipeline schedules: what one rank does, one small action at a time.
#pragma once

#include <cstdint>
#include <string>

namespace megart::schedule {

enum class Op : std::uint8_t {
  Forward,         // "F": forward of one (microbatch, chunk)
  Backward,        // "B": full backward (input and weight gradients)
  BackwardInput,   // "I": input gradient only (zero-bubble kinds)
  BackwardWeight,  // "W": weight gradient only (zero-bubble kinds)
  SendForward,     // "SEND_F": activation to the next virtual stage
  RecvForward,     // "RECV_F": activation from the previous virtual stage
  SendBackward,    // "SEND_B": input gradient to the previous virtual stage
  RecvBackward,    // "RECV_B": output gradient from the next virtual stage
};
inline constexpr int kNumOps = 8;

struct Action {
  Op op = Op::Forward;
  int microbatch = 0;
  int chunk = 0;  // the model chunk on this rank that computes, produced or consumes the data
  int peer = -1;  // the other rank of a communication action; -1 for compute

  bool operator==(const Action& o) const {
    return op == o.op && microbatch == o.microbatch && chunk == o.chunk && peer == o.peer;
  }
  bool operator!=(const Action& o) const { return !(*this == o); }
};

bool is_compute(Op op);
bool is_send(Op op);
bool is_recv(Op op);
// The compute ops that a gradient travels after: B, or I when the backward is split.
bool sends_gradient(Op op);

const char* op_name(Op op);                // "F", "B", "I", "W", "SEND_F", ...
Op op_from_name(const std::string& name);  // throws ConfigError on an unknown name
std::string to_string(const Action& a);    // "F(mb=3, chunk=1)", "SEND_F(mb=3, chunk=1, peer=2)"

}  // namespace megart::schedule
