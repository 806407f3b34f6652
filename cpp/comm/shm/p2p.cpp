// Point-to-point messages through the ring of each ordered pair of ranks. A message is a header
// (size and dtype, and where the sender grouped it: a mismatch between the two sides is an
// error rather than corrupted data or, on NCCL, undefined behaviour) followed by the payload,
// streamed through the ring as space allows. A payload at least a ring long is not streamed: the
// header says where it lies, the receiver copies it straight from the sender's memory
// (process_vm_readv, one copy instead of two) and answers in the channel head; the send completes
// on that answer, or streams the payload after all when the receiver could not read it.
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/shm/tasks.hpp"
#include "common/error.hpp"

namespace megart::comm::shm {

namespace {

struct MessageHeader {
  std::uint64_t bytes;
  std::uint32_t dtype;
  std::uint32_t magic;
  std::uint64_t direct;   // k > 0: direct message k, the payload is read from address in pid
  std::uint64_t address;  // direct messages: where the payload lies in the sender's memory
  std::int64_t pid;       // direct messages: the sender's process
  PairGroup group;        // the sender's batch with the receiver (see PairGroup)
};
static_assert(sizeof(MessageHeader) == 56);
constexpr std::uint32_t kMessageMagic = 0x6d736733;  // "msg3"

class P2P : public Task {
 public:
  P2P(Buffer b, int src, int dst, PairGroup group) : b_(b), src_(src), dst_(dst) {
    header_ = MessageHeader{b.bytes(), static_cast<std::uint32_t>(b.dtype), kMessageMagic, 0, 0, 0,
                            group};
  }
  bool collective() const override { return false; }

 protected:
  // The stream: the header's bytes, then the payload's unless it goes by a direct read.
  std::uint64_t total() const { return sizeof(MessageHeader) + (streamed_ ? b_.bytes() : 0); }
  std::uint8_t* stream_at(std::uint64_t offset, std::uint64_t* contiguous) {
    if (offset < sizeof(MessageHeader)) {
      *contiguous = sizeof(MessageHeader) - offset;
      return reinterpret_cast<std::uint8_t*>(&header_) + offset;
    }
    *contiguous = total() - offset;
    return static_cast<std::uint8_t*>(b_.data) + (offset - sizeof(MessageHeader));
  }

  Buffer b_;
  int src_, dst_;
  MessageHeader header_;
  std::uint64_t offset_ = 0;  // bytes of the stream moved so far
  bool streamed_ = true;      // false while the payload goes by a direct read
};

class Send final : public P2P {
 public:
  using P2P::P2P;
  std::string describe() const override {
    return "send(" + std::to_string(b_.count) + " x " + dtype_name(b_.dtype) + " to rank " +
           std::to_string(dst_) + ")";
  }
  std::vector<int> waiting_on(const ShmCommunicator&) const override { return {dst_}; }
  std::pair<int, int> lane() const override { return {dst_, 0}; }

  bool step(ShmCommunicator& c) override {
    ChannelHead* head = c.layout().channel(c.base(), src_, dst_);
    const std::uint64_t cap = c.layout().channel_bytes();
    if (offset_ == 0 && header_.direct == 0 && b_.bytes() >= cap && c.direct_to(dst_)) {
      // A message at least a ring long would be copied twice through the ring, in ring-sized
      // steps that alternate between the two sides: the receiver reads it from here instead.
      header_.direct = head->direct_sent.load(std::memory_order_relaxed) + 1;
      head->direct_sent.store(header_.direct, std::memory_order_relaxed);  // ours alone
      header_.address = reinterpret_cast<std::uintptr_t>(b_.data);
      header_.pid = getpid();
      streamed_ = false;
    }
    stream(c, head, cap);
    if (offset_ < total()) return false;
    if (!streamed_) {
      const std::uint64_t reply = head->direct_reply.load(std::memory_order_acquire);
      if (reply == 2 * header_.direct + 1) {  // it could not read: the payload follows
        c.no_direct_to(dst_);
        streamed_ = true;
        return step(c);
      }
      if (reply != 2 * header_.direct) return false;  // not read yet
    }
    c.count_sent(dst_, b_.bytes());
    return true;
  }

 private:
  // Writes what fits of the stream into the ring.
  void stream(ShmCommunicator& c, ChannelHead* head, std::uint64_t cap) {
    std::uint8_t* ring = c.layout().ring(c.base(), src_, dst_);
    std::uint64_t written = head->written.load(std::memory_order_relaxed);  // ours alone
    const std::uint64_t read = head->read.load(std::memory_order_acquire);
    const std::uint64_t before = offset_;
    while (offset_ < total() && written - read < cap) {
      std::uint64_t len;
      const std::uint8_t* src = stream_at(offset_, &len);
      const std::uint64_t pos = written % cap;
      len = std::min({len, cap - (written - read), cap - pos});
      std::memcpy(ring + pos, src, len);
      written += len;
      offset_ += len;
    }
    if (offset_ == before) return;
    head->written.store(written, std::memory_order_release);
    c.signal();
    ++moved;
  }
};

class Recv final : public P2P {
 public:
  using P2P::P2P;
  std::string describe() const override {
    return "recv(" + std::to_string(b_.count) + " x " + dtype_name(b_.dtype) + " from rank " +
           std::to_string(src_) + ")";
  }
  std::vector<int> waiting_on(const ShmCommunicator&) const override { return {src_}; }
  std::pair<int, int> lane() const override { return {src_, 1}; }

  bool step(ShmCommunicator& c) override {
    ChannelHead* head = c.layout().channel(c.base(), src_, dst_);
    const std::uint8_t* ring = c.layout().ring(c.base(), src_, dst_);
    const std::uint64_t cap = c.layout().channel_bytes();
    const std::uint64_t written = head->written.load(std::memory_order_acquire);
    std::uint64_t read = head->read.load(std::memory_order_relaxed);  // ours alone
    const std::uint64_t before = offset_;
    while (offset_ < total() && read < written) {
      if (offset_ == sizeof(MessageHeader) && !checked_) break;  // see below first
      std::uint64_t len;
      std::uint8_t* dst = offset_ < sizeof(MessageHeader)
                              ? reinterpret_cast<std::uint8_t*>(&incoming_) + offset_
                              : stream_at(offset_, &len);
      if (offset_ < sizeof(MessageHeader)) len = sizeof(MessageHeader) - offset_;
      const std::uint64_t pos = read % cap;
      len = std::min({len, written - read, cap - pos});
      std::memcpy(dst, ring + pos, len);
      read += len;
      offset_ += len;
    }
    if (offset_ != before) {
      head->read.store(read, std::memory_order_release);
      c.signal();
      ++moved;
    }
    if (offset_ == sizeof(MessageHeader) && !checked_) {
      check_header();
      if (incoming_.direct != 0) read_directly(c, head);
      return step(c);  // the payload that may already wait in the ring, or done
    }
    return offset_ == total();
  }

 private:
  void check_header() {
    checked_ = true;
    if (incoming_.magic != kMessageMagic) {
      throw CommError("corrupt message from rank " + std::to_string(src_) + " in " + describe());
    }
    if (incoming_.bytes != header_.bytes || incoming_.dtype != header_.dtype) {
      throw CommError("rank " + std::to_string(src_) + " sent " + std::to_string(incoming_.bytes) +
                      " bytes of " + dtype_name(static_cast<DType>(incoming_.dtype)) + " but " +
                      describe() + " expects " + std::to_string(header_.bytes) + " bytes of " +
                      dtype_name(b_.dtype) + "; sends and receives must agree in size and dtype");
    }
    const PairGroup& theirs = incoming_.group;
    const PairGroup& mine = header_.group;
    if (theirs.index != mine.index || theirs.sends != mine.recvs || theirs.recvs != mine.sends) {
      throw CommError(
          describe() + ": rank " + std::to_string(src_) + " grouped its messages with this rank " +
          "differently: its batch " + std::to_string(theirs.index) + " with this rank holds " +
          std::to_string(theirs.sends) + " send(s) to it and " + std::to_string(theirs.recvs) +
          " receive(s) from it, this rank's batch " + std::to_string(mine.index) + " holds " +
          std::to_string(mine.recvs) + " receive(s) and " + std::to_string(mine.sends) +
          " send(s); post the ops between two ranks in the same batches on both (NCCL leaves "
          "other groupings undefined)");
    }
  }

  // Copies the payload straight from the sender's memory. Where the system refuses
  // (process_vm_readv needs ptrace rights over the sender, which some containers and Yama
  // settings withhold), the answer says so and the sender streams the payload instead.
  void read_directly(ShmCommunicator& c, ChannelHead* head) {
    std::uint64_t done = 0;
    const std::uint64_t bytes = incoming_.bytes;
    while (done < bytes && !c.refuse_direct()) {
      iovec local{static_cast<std::uint8_t*>(b_.data) + done, bytes - done};
      iovec remote{reinterpret_cast<void*>(incoming_.address + done), bytes - done};
      const ssize_t n =
          process_vm_readv(static_cast<pid_t>(incoming_.pid), &local, 1, &remote, 1, 0);
      if (n <= 0) break;
      done += static_cast<std::uint64_t>(n);
    }
    const bool whole = done == bytes;
    streamed_ = !whole;  // refused: the payload comes through the ring after all
    head->direct_reply.store(2 * incoming_.direct + (whole ? 0 : 1), std::memory_order_release);
    c.signal();
    ++moved;
  }

  MessageHeader incoming_{};
  bool checked_ = false;
};

}  // namespace

std::shared_ptr<Task> make_send(Buffer buffer, int me, int peer, PairGroup group) {
  return std::make_shared<Send>(buffer, me, peer, group);
}
std::shared_ptr<Task> make_recv(Buffer buffer, int me, int peer, PairGroup group) {
  return std::make_shared<Recv>(buffer, peer, me, group);
}

}  // namespace megart::comm::shm
