// POSIX shared memory and futex waits: the two kernel services the shm transport stands on.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

namespace megart::comm::shm {

// A mapping of a named POSIX shared-memory object, unmapped on destruction (move-only).
class Segment {
 public:
  // Creates the object (it must not exist), sized and zero-filled. Refuses, naming the size
  // needed, when /dev/shm has less room than `bytes` (tmpfs would give a SIGBUS later instead).
  static Segment create(const std::string& name, std::size_t bytes);
  // Opens an object another process (`creator`, when > 0) creates, retrying until it appears;
  // fails when `timeout` passes or the creator's process is gone.
  static Segment open(const std::string& name, std::size_t bytes, std::chrono::milliseconds timeout,
                      std::int32_t creator = 0);
  Segment(Segment&& o) noexcept;
  Segment& operator=(Segment&& o) noexcept;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment();

  std::uint8_t* data() const { return static_cast<std::uint8_t*>(addr_); }
  std::size_t size() const { return bytes_; }
  // Removes the name; the memory lives on while any process keeps it mapped.
  void unlink();

 private:
  Segment(std::string name, void* addr, std::size_t bytes)
      : name_(std::move(name)), addr_(addr), bytes_(bytes) {}
  std::string name_;
  void* addr_ = nullptr;
  std::size_t bytes_ = 0;
};

// Sleeps while *word == expected, for at most `timeout` (a wake, a change of the word or a
// signal ends it early). The word may be shared between processes.
void futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected,
                std::chrono::nanoseconds timeout);
void futex_wake_all(std::atomic<std::uint32_t>* word);

// Whether process `pid` still runs. A zombie (exited, not yet reaped by its parent, as a
// crashed rank is until its launcher collects it) counts as gone.
bool process_alive(std::int32_t pid);

}  // namespace megart::comm::shm
