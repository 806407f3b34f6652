// What lives in a group's shared-memory segment, and where.
//
//   Header | RankSlot x n | staging: n ranks x 2 halves | channels: n x n byte rings
//
// Collectives go through the staging areas in numbered steps: a rank copies its part into its
// staging half (step % 2), raises `staged`, reads everyone's, then raises `consumed`; two halves
// let step s+1 be staged while slow readers still read step s. Point-to-point messages stream
// through one single-producer single-consumer ring per ordered pair of ranks.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace megart::comm::shm {

inline constexpr std::uint64_t kMagic = 0x6d65676172747368ull;  // "megartsh"

struct alignas(64) Header {
  std::atomic<std::uint64_t> magic;  // written last by rank 0: the header is ready
  std::uint32_t size;
  std::uint32_t reserved;
  std::uint64_t staging_bytes;            // per rank, both halves
  std::uint64_t channel_bytes;            // per ring
  std::atomic<std::uint32_t> generation;  // futex word: bumped by every signal
  std::atomic<std::uint32_t> waiters;     // processes asleep on `generation`
  std::atomic<std::int32_t> aborted_by;   // -1, or the rank that aborted the group
  std::atomic<std::uint32_t> attached;    // ranks that have mapped the segment
  // 1 + the global rank first seen to fail (a dead process), 0 while none has: zero-filled
  // memory needs no initialisation.
  std::atomic<std::int32_t> first_failed;
};

struct alignas(64) RankSlot {
  std::atomic<std::uint64_t> staged;        // last collective step whose staging is written
  std::atomic<std::uint64_t> consumed;      // last collective step this rank has finished reading
  std::atomic<std::uint64_t> signature[2];  // what the rank staged, per half (mismatch check)
  std::atomic<std::int32_t> pid;
};

// Bytes are counted from the start: written - read is what the ring holds. The sender owns the
// first cache line, the receiver the second.
struct alignas(64) ChannelHead {
  std::atomic<std::uint64_t> written;
  std::atomic<std::uint64_t> direct_sent;  // messages the receiver was asked to read directly
  char pad[48];
  std::atomic<std::uint64_t> read;
  // The receiver's answer to direct message k: 2k when it read the payload, 2k+1 when it could
  // not (the sender then streams the payload through the ring).
  std::atomic<std::uint64_t> direct_reply;
};

class Layout {
 public:
  Layout(int size, std::size_t staging_bytes, std::size_t channel_bytes)
      : size_(size), staging_(staging_bytes), channel_(channel_bytes) {}

  std::size_t total_bytes() const { return channels_offset() + ring_stride() * size_ * size_; }

  Header* header(std::uint8_t* base) const { return reinterpret_cast<Header*>(base); }
  RankSlot* slot(std::uint8_t* base, int rank) const {
    return reinterpret_cast<RankSlot*>(base + sizeof(Header)) + rank;
  }
  std::uint8_t* staging(std::uint8_t* base, int rank, std::uint64_t step) const {
    return base + staging_offset() + rank * staging_ + (step % 2) * half_staging();
  }
  std::size_t half_staging() const { return staging_ / 2; }
  ChannelHead* channel(std::uint8_t* base, int src, int dst) const {
    return reinterpret_cast<ChannelHead*>(base + channels_offset() +
                                          ring_stride() * (src * size_ + dst));
  }
  std::uint8_t* ring(std::uint8_t* base, int src, int dst) const {
    return reinterpret_cast<std::uint8_t*>(channel(base, src, dst)) + sizeof(ChannelHead);
  }
  std::size_t channel_bytes() const { return channel_; }

 private:
  static std::size_t round_up(std::size_t x) { return (x + 4095) / 4096 * 4096; }
  std::size_t staging_offset() const { return round_up(sizeof(Header) + sizeof(RankSlot) * size_); }
  std::size_t channels_offset() const { return round_up(staging_offset() + staging_ * size_); }
  std::size_t ring_stride() const { return round_up(sizeof(ChannelHead) + channel_); }

  int size_;
  std::size_t staging_;
  std::size_t channel_;
};

}  // namespace megart::comm::shm
