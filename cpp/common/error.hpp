// Typed errors of the megart core. Every message says what went wrong and, where it can, what to
// change. The bindings map each type to a Python exception of the same name.
#pragma once

#include <stdexcept>
#include <string>

namespace megart {

// Base of every error raised by the core.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A bad argument or layout (Python: megart.ConfigError, also a ValueError).
class ConfigError : public Error {
 public:
  using Error::Error;
};

// A schedule that breaks a rule: missing or duplicated actions, unmatched sends and receives.
class ScheduleError : public Error {
 public:
  using Error::Error;
};

// A schedule that cannot make progress: the message names the blocked ranks and what they wait on.
class DeadlockError : public ScheduleError {
 public:
  using ScheduleError::ScheduleError;
};

}  // namespace megart

namespace megart {

// A communication op failed: a dead or stuck peer, an abort, a size mismatch between ranks.
class CommError : public Error {
 public:
  using Error::Error;
};

// A wait ran past its timeout (Python: megart.CommTimeoutError, also a TimeoutError).
class CommTimeoutError : public CommError {
 public:
  using CommError::CommError;
};

}  // namespace megart
