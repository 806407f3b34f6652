// POSIX shared memory and futex waits: the two kernel services the shm transport stands on.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

namespace megart::comm::shm {

// A mapping of a named POSIX shared-memory object, unmapped on destruction (move-only).
class Segment {
 public:
  // Creates the object (it must not exist), sized and zero-filled.
  static Segment create(const std::string& name, std::size_t bytes);
  // Opens an object another process creates, retrying until it appears or `timeout` passes.
  static Segment open(const std::string& name, std::size_t bytes,
                      std::chrono::milliseconds timeout);
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

}  // namespace megart::comm::shm
