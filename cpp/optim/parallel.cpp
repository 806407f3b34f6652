#include "optim/parallel.hpp"

#include <sched.h>

#include <cstdlib>
#include <string>
#include <thread>

#include "common/error.hpp"

namespace megart::optim {

namespace {

// Below this many elements per worker a thread costs more than it saves: starting and joining
// one takes some tens of microseconds, about the time one core needs for 64K Adam elements.
constexpr int64_t kMinElementsPerWorker = 1 << 16;

// Split points fall on multiples of this many elements, so each worker's vector loop runs over
// whole cache lines and two workers never write the same line.
constexpr int64_t kAlign = 64;

int available_cpus() {
#ifdef __linux__
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
#endif
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

}  // namespace

int resolve_threads(int requested) {
  if (requested < 0) {
    throw ConfigError("num_threads must be positive (or 0 for automatic), got " +
                      std::to_string(requested));
  }
  if (requested > 0) return requested;
  if (const char* env = std::getenv("MEGART_NUM_THREADS"); env != nullptr && *env != '\0') {
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    if (end == env || *end != '\0' || n < 1 || n > 4096) {
      throw ConfigError(std::string("MEGART_NUM_THREADS must be a positive integer, got '") + env +
                        "'");
    }
    return static_cast<int>(n);
  }
  return available_cpus();
}

std::vector<int64_t> flat_offsets(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> offsets(sizes.size() + 1, 0);
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] < 0) throw ConfigError("tensor " + std::to_string(i) + " has a negative size");
    offsets[i + 1] = offsets[i] + sizes[i];
  }
  return offsets;
}

// Threads are started per call rather than kept in a pool: a step over a model big enough to
// need several threads takes milliseconds, so tens of microseconds to start them is noise; small
// steps run inline (kMinElementsPerWorker); and no thread outlives a call, so nothing breaks when
// a data-loader process forks, and no global state is needed.
int parallel_for(int64_t total, int threads,
                 const std::function<void(int worker, int64_t begin, int64_t end)>& body) {
  if (total <= 0) return 0;
  int64_t workers = total / kMinElementsPerWorker;
  if (workers > threads) workers = threads;
  if (workers < 1) workers = 1;
  if (workers == 1) {
    body(0, 0, total);
    return 1;
  }
  const int64_t per_worker = (total / workers + kAlign - 1) / kAlign * kAlign;
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(workers - 1));
  // Joins whatever was started even when starting a later thread throws.
  struct Joiner {
    std::vector<std::thread>& threads;
    ~Joiner() {
      for (auto& t : threads) {
        if (t.joinable()) t.join();
      }
    }
  } joiner{pool};
  // Worker 0 runs on the calling thread; the others get their own.
  for (int64_t w = 1; w < workers; ++w) {
    const int64_t begin = w * per_worker;
    const int64_t end = w + 1 == workers ? total : (w + 1) * per_worker;
    if (begin >= total) break;
    pool.emplace_back(body, static_cast<int>(w), begin, end < total ? end : total);
  }
  body(0, 0, per_worker < total ? per_worker : total);
  return static_cast<int>(workers);
}

}  // namespace megart::optim
