#include "comm/shm/segment.hpp"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <thread>

#include "common/error.hpp"

namespace megart::comm::shm {

namespace {

std::string errno_text(const std::string& what, const std::string& name) {
  return what + " of shared memory '" + name + "' failed: " + std::strerror(errno);
}

void* map(int fd, std::size_t bytes, const std::string& name) {
  void* addr = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int saved = errno;
  close(fd);
  errno = saved;
  if (addr == MAP_FAILED) throw CommError(errno_text("mmap", name));
  return addr;
}

}  // namespace

Segment Segment::create(const std::string& name, std::size_t bytes) {
  // tmpfs hands out pages only when they are touched: a segment larger than the room left
  // maps fine and kills the process with SIGBUS at its first write past the room.
  struct statvfs vfs{};
  if (statvfs("/dev/shm", &vfs) == 0) {
    const std::size_t room = static_cast<std::size_t>(vfs.f_bavail) * vfs.f_frsize;
    if (room < bytes) {
      throw CommError("shared memory '" + name + "' needs " + std::to_string((bytes >> 20) + 1) +
                      " MiB but /dev/shm has " + std::to_string(room >> 20) +
                      " MiB free: enlarge /dev/shm (docker run --shm-size, or mount -o "
                      "remount,size=...) or run fewer processes per machine");
    }
  }
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw CommError(errno_text("shm_open", name));
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const std::string msg = errno_text("ftruncate", name) +
                            " (is /dev/shm large enough? it needs " + std::to_string(bytes >> 20) +
                            " MiB)";
    close(fd);
    shm_unlink(name.c_str());
    throw CommError(msg);
  }
  return Segment(name, map(fd, bytes, name), bytes);
}

Segment Segment::open(const std::string& name, std::size_t bytes, std::chrono::milliseconds timeout,
                      std::int32_t creator) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (int tries = 0;; ++tries) {
    const int fd = shm_open(name.c_str(), O_RDWR, 0600);
    if (fd >= 0) {
      struct stat st{};
      if (fstat(fd, &st) == 0 && static_cast<std::size_t>(st.st_size) >= bytes) {
        return Segment(name, map(fd, bytes, name), bytes);
      }
      close(fd);  // created but not yet sized: retry
    } else if (errno != ENOENT) {
      throw CommError(errno_text("shm_open", name));
    }
    if (creator > 0 && tries % 100 == 99 && !process_alive(creator)) {
      shm_unlink(name.c_str());  // it may have created the object just before it died
      throw CommError("shared memory '" + name + "': rank 0 of the group (pid " +
                      std::to_string(creator) + ") exited before creating it");
    }
    if (std::chrono::steady_clock::now() > deadline) {
      throw CommTimeoutError("shared memory '" + name + "' did not appear within " +
                             std::to_string(timeout.count()) +
                             " ms: did rank 0 of the group start?");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

Segment::Segment(Segment&& o) noexcept
    : name_(std::move(o.name_)), addr_(o.addr_), bytes_(o.bytes_) {
  o.addr_ = nullptr;
}

Segment& Segment::operator=(Segment&& o) noexcept {
  if (this != &o) {
    if (addr_) munmap(addr_, bytes_);
    name_ = std::move(o.name_);
    addr_ = o.addr_;
    bytes_ = o.bytes_;
    o.addr_ = nullptr;
  }
  return *this;
}

Segment::~Segment() {
  if (addr_) munmap(addr_, bytes_);
}

void Segment::unlink() { shm_unlink(name_.c_str()); }

void futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected,
                std::chrono::nanoseconds timeout) {
  const auto ns = timeout.count() > 0 ? timeout.count() : 0;
  struct timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  // Not FUTEX_PRIVATE: the word lives in memory shared between processes.
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<std::uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr,
          0);
}

bool process_alive(std::int32_t pid) {
  if (kill(pid, 0) != 0) return errno != ESRCH;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return true;
  const auto paren = line.rfind(')');
  if (paren == std::string::npos || paren + 2 >= line.size()) return true;
  const char state = line[paren + 2];
  return state != 'Z' && state != 'X';
}

}  // namespace megart::comm::shm
