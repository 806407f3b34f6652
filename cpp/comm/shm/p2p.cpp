// Point-to-point messages through the ring of each ordered pair of ranks. A message is a
// 16-byte header (size and dtype, so a mismatch between the two sides is an error rather than
// corrupted data) followed by the payload, streamed through the ring as space allows.
#include <algorithm>
#include <cstring>

#include "comm/shm/tasks.hpp"
#include "common/error.hpp"

namespace megart::comm::shm {

namespace {

struct MessageHeader {
  std::uint64_t bytes;
  std::uint32_t dtype;
  std::uint32_t magic;
};
static_assert(sizeof(MessageHeader) == 16);
constexpr std::uint32_t kMessageMagic = 0x6d736731;  // "msg1"

class P2P : public Task {
 public:
  P2P(Buffer b, int src, int dst) : b_(b), src_(src), dst_(dst) {
    header_ = MessageHeader{b.bytes(), static_cast<std::uint32_t>(b.dtype), kMessageMagic};
  }
  bool collective() const override { return false; }

 protected:
  // The stream: the header's bytes, then the payload's.
  std::uint64_t total() const { return sizeof(MessageHeader) + b_.bytes(); }
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
    std::uint8_t* ring = c.layout().ring(c.base(), src_, dst_);
    const std::uint64_t cap = c.layout().channel_bytes();
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
    if (offset_ != before) {
      head->written.store(written, std::memory_order_release);
      c.signal();
      ++moved;
    }
    if (offset_ < total()) return false;
    c.count_sent(dst_, b_.bytes());
    return true;
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
      if (offset_ == sizeof(MessageHeader)) check_header();
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
    if (offset_ == sizeof(MessageHeader)) check_header();  // an empty payload
    return offset_ == total();
  }

 private:
  void check_header() {
    if (checked_) return;
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
  }
  MessageHeader incoming_{};
  bool checked_ = false;
};

}  // namespace

std::shared_ptr<Task> make_send(Buffer buffer, int me, int peer) {
  return std::make_shared<Send>(buffer, me, peer);
}
std::shared_ptr<Task> make_recv(Buffer buffer, int me, int peer) {
  return std::make_shared<Recv>(buffer, peer, me);
}

}  // namespace megart::comm::shm
