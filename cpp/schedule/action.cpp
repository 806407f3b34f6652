#include "schedule/action.hpp"

#include <array>

#include "common/error.hpp"

namespace megart::schedule {

namespace {
constexpr std::array<const char*, kNumOps> kNames = {"F",      "B",      "I",      "W",
                                                     "SEND_F", "RECV_F", "SEND_B", "RECV_B"};
}  // namespace

bool is_compute(Op op) { return op <= Op::BackwardWeight; }
bool is_send(Op op) { return op == Op::SendForward || op == Op::SendBackward; }
bool is_recv(Op op) { return op == Op::RecvForward || op == Op::RecvBackward; }
bool sends_gradient(Op op) { return op == Op::Backward || op == Op::BackwardInput; }

const char* op_name(Op op) { return kNames[static_cast<int>(op)]; }

Op op_from_name(const std::string& name) {
  for (int i = 0; i < kNumOps; ++i) {
    if (name == kNames[i]) return static_cast<Op>(i);
  }
  throw ConfigError("unknown schedule op '" + name +
                    "'; expected one of F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B");
}

std::string to_string(const Action& a) {
  std::string s = std::string(op_name(a.op)) + "(mb=" + std::to_string(a.microbatch) +
                  ", chunk=" + std::to_string(a.chunk);
  if (!is_compute(a.op)) s += ", peer=" + std::to_string(a.peer);
  return s + ")";
}

}  // namespace megart::schedule
