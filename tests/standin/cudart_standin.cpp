// The CUDA runtime stand-in (see cuda_runtime.h and BEHAVIOUR.md). Every stream is a worker
// thread that runs its queue in order, sleeping a seeded random delay before each item, so work
// on two streams really overlaps and an ordering the code forgot shows up as a wrong result.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <unordered_map>

#include "cuda_runtime.h"
#include "standin.h"

struct CUstream_st;
struct CUevent_st;

namespace {

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoi(v) : fallback;
}

std::atomic<unsigned long long> g_seed{
    static_cast<unsigned long long>(env_int("MEGART_STANDIN_SEED", 12345))};
std::atomic<unsigned int> g_max_delay_us{
    static_cast<unsigned int>(env_int("MEGART_STANDIN_MAX_DELAY_US", 200))};
std::atomic<unsigned long long> g_stream_serial{0};
std::atomic<unsigned long long> g_events_created{0};

// CUDA keeps the last error per host thread; cudaGetLastError returns and clears it.
thread_local cudaError_t t_last_error = cudaSuccess;
thread_local int t_device = 0;

cudaError_t fail(cudaError_t e) {
  t_last_error = e;
  return e;
}

int device_count() { return env_int("MEGART_STANDIN_DEVICES", 8); }

class Stream {
 public:
  explicit Stream(int device) : device_(device), serial_(++g_stream_serial) {
    worker_ = std::thread([this] { run(); });
  }
  ~Stream() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    worker_.join();  // runs the rest of the queue first, as cudaStreamDestroy promises
  }
  int device() const { return device_; }
  void enqueue(std::function<void()> item) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(item));
      ++pending_;
    }
    cv_.notify_all();
  }
  std::size_t pending() {
    std::lock_guard<std::mutex> lock(mu_);
    return pending_;
  }
  void synchronize() {
    std::unique_lock<std::mutex> lock(mu_);
    idle_.wait(lock, [&] { return pending_ == 0; });
  }

 private:
  void run() {
    std::mt19937_64 rng(g_seed.load() ^ (serial_ * 0x9E3779B97F4A7C15ull));
    unsigned long long seen_seed = g_seed.load();
    for (;;) {
      std::function<void()> item;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        item = std::move(queue_.front());
        queue_.pop_front();
      }
      if (g_seed.load() != seen_seed) {
        seen_seed = g_seed.load();
        rng.seed(seen_seed ^ (serial_ * 0x9E3779B97F4A7C15ull));
      }
      const unsigned int max_delay = g_max_delay_us.load();
      if (max_delay > 0) {
        std::this_thread::sleep_for(std::chrono::microseconds(rng() % (max_delay + 1)));
      }
      item();
      {
        std::lock_guard<std::mutex> lock(mu_);
        --pending_;
      }
      idle_.notify_all();
    }
  }

  int device_;
  unsigned long long serial_;
  std::mutex mu_;
  std::condition_variable cv_, idle_;
  std::deque<std::function<void()>> queue_;
  std::size_t pending_ = 0;
  bool stopping_ = false;
  std::thread worker_;
};

// An event remembers which of its records have completed: a stream wait captures the record
// current at the call, as cudaStreamWaitEvent does, so re-recording the event later does not
// change what an earlier wait waits for.
class Event {
 public:
  explicit Event(int device) : device_(device) {}
  int device() const { return device_; }
  std::uint64_t record() {
    std::lock_guard<std::mutex> lock(mu_);
    return ++recorded_;
  }
  std::uint64_t latest() {
    std::lock_guard<std::mutex> lock(mu_);
    return recorded_;
  }
  void complete(std::uint64_t gen) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_.insert(gen);
    }
    cv_.notify_all();
  }
  bool is_done(std::uint64_t gen) {
    std::lock_guard<std::mutex> lock(mu_);
    return gen == 0 || done_.count(gen) > 0;
  }
  void wait(std::uint64_t gen) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return gen == 0 || done_.count(gen) > 0; });
  }

 private:
  int device_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::uint64_t recorded_ = 0;  // 0: never recorded, which counts as complete
  std::set<std::uint64_t> done_;
};

// Handles are the objects' addresses; the registries tell live handles from destroyed ones.
std::mutex g_mu;
std::unordered_map<CUstream_st*, std::shared_ptr<Stream>> g_streams;
std::unordered_map<CUevent_st*, std::shared_ptr<Event>> g_events;
std::map<int, std::shared_ptr<Stream>> g_legacy;                   // each device's default stream
std::map<const char*, std::pair<std::size_t, int>> g_allocations;  // start -> (bytes, device)

std::shared_ptr<Stream> find_stream(cudaStream_t s) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (s == nullptr) {
    auto& legacy = g_legacy[t_device];
    if (!legacy) legacy = std::make_shared<Stream>(t_device);
    return legacy;
  }
  const auto it = g_streams.find(s);
  return it == g_streams.end() ? nullptr : it->second;
}

std::shared_ptr<Event> find_event(cudaEvent_t e) {
  std::lock_guard<std::mutex> lock(g_mu);
  const auto it = g_events.find(e);
  return it == g_events.end() ? nullptr : it->second;
}

}  // namespace

extern "C" {

const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorNoDevice:
      return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle:
      return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady:
      return "cudaErrorNotReady";
  }
  return "cudaErrorUnknown";
}

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorNoDevice:
      return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle:
      return "invalid resource handle";
    case cudaErrorNotReady:
      return "device not ready";
  }
  return "unknown error";
}

cudaError_t cudaGetLastError(void) {
  const cudaError_t e = t_last_error;
  t_last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError(void) { return t_last_error; }

cudaError_t cudaGetDeviceCount(int* count) {
  if (count == nullptr) return fail(cudaErrorInvalidValue);
  *count = device_count();
  return *count > 0 ? cudaSuccess : fail(cudaErrorNoDevice);
}

cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return fail(cudaErrorInvalidValue);
  *device = t_device;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= device_count()) return fail(cudaErrorInvalidDevice);
  t_device = device;
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
  std::vector<std::shared_ptr<Stream>> streams;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    for (auto& [h, s] : g_streams) {
      if (s->device() == t_device) streams.push_back(s);
    }
    if (auto it = g_legacy.find(t_device); it != g_legacy.end()) streams.push_back(it->second);
  }
  for (auto& s : streams) s->synchronize();
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  if (stream == nullptr || flags > cudaStreamNonBlocking) return fail(cudaErrorInvalidValue);
  auto s = std::make_shared<Stream>(t_device);
  auto* handle = reinterpret_cast<CUstream_st*>(s.get());
  std::lock_guard<std::mutex> lock(g_mu);
  g_streams[handle] = std::move(s);
  *stream = handle;
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  return cudaStreamCreateWithFlags(stream, cudaStreamDefault);
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  std::shared_ptr<Stream> s;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    const auto it = g_streams.find(stream);
    if (stream == nullptr || it == g_streams.end()) return fail(cudaErrorInvalidResourceHandle);
    s = std::move(it->second);
    g_streams.erase(it);
  }
  // CUDA returns at once and frees the stream once its work is done: the last owner (this
  // detached thread) joins the worker after the queue has run.
  std::thread([s = std::move(s)]() mutable { s.reset(); }).detach();
  return cudaSuccess;
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
  auto s = find_stream(stream);
  if (!s) return fail(cudaErrorInvalidResourceHandle);
  return s->pending() == 0 ? cudaSuccess : cudaErrorNotReady;  // not-ready is not an error
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  auto s = find_stream(stream);
  if (!s) return fail(cudaErrorInvalidResourceHandle);
  s->synchronize();
  return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  auto s = find_stream(stream);
  auto e = find_event(event);
  if (!s || !e) return fail(cudaErrorInvalidResourceHandle);
  if (flags != 0) return fail(cudaErrorInvalidValue);
  const std::uint64_t gen = e->latest();  // the record current now, not a later one
  s->enqueue([e, gen] { e->wait(gen); });
  return cudaSuccess;
}

cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void* user_data) {
  auto s = find_stream(stream);
  if (!s) return fail(cudaErrorInvalidResourceHandle);
  if (fn == nullptr) return fail(cudaErrorInvalidValue);
  s->enqueue([fn, user_data] { fn(user_data); });
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  if (event == nullptr || flags > (cudaEventBlockingSync | cudaEventDisableTiming)) {
    return fail(cudaErrorInvalidValue);
  }
  auto e = std::make_shared<Event>(t_device);
  ++g_events_created;
  auto* handle = reinterpret_cast<CUevent_st*>(e.get());
  std::lock_guard<std::mutex> lock(g_mu);
  g_events[handle] = std::move(e);
  *event = handle;
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  return cudaEventCreateWithFlags(event, cudaEventDefault);
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  auto s = find_stream(stream);
  auto e = find_event(event);
  if (!s || !e) return fail(cudaErrorInvalidResourceHandle);
  // CUDA: "event and stream must be on the same device".
  if (s->device() != e->device()) return fail(cudaErrorInvalidResourceHandle);
  const std::uint64_t gen = e->record();
  s->enqueue([e, gen] { e->complete(gen); });
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  auto e = find_event(event);
  if (!e) return fail(cudaErrorInvalidResourceHandle);
  return e->is_done(e->latest()) ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  auto e = find_event(event);
  if (!e) return fail(cudaErrorInvalidResourceHandle);
  e->wait(e->latest());
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  std::lock_guard<std::mutex> lock(g_mu);
  // Queued records and waits hold the event themselves: CUDA releases it once they are done.
  if (g_events.erase(event) == 0) return fail(cudaErrorInvalidResourceHandle);
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** ptr, std::size_t size) {
  if (ptr == nullptr) return fail(cudaErrorInvalidValue);
  void* p = std::aligned_alloc(256, std::max<std::size_t>(256, (size + 255) / 256 * 256));
  if (p == nullptr) return fail(cudaErrorMemoryAllocation);
  std::lock_guard<std::mutex> lock(g_mu);
  g_allocations[static_cast<const char*>(p)] = {size, t_device};
  *ptr = p;
  return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
  if (ptr == nullptr) return cudaSuccess;
  // cudaFree synchronizes with the device before it releases the memory.
  const int device = megartStandinPointerDevice(ptr);
  if (device >= 0) {
    const int current = t_device;
    t_device = device;
    cudaDeviceSynchronize();
    t_device = current;
  }
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_allocations.erase(static_cast<const char*>(ptr)) == 0) {
      return fail(cudaErrorInvalidValue);
    }
  }
  std::free(ptr);
  return cudaSuccess;
}

cudaError_t cudaMemset(void* ptr, int value, std::size_t count) {
  if (megartStandinPointerDevice(ptr) < 0) return fail(cudaErrorInvalidValue);
  // CUDA's "API synchronization behavior": a memset of device memory is asynchronous with
  // respect to the host, on the legacy default stream.
  find_stream(nullptr)->enqueue([ptr, value, count] { std::memset(ptr, value, count); });
  return cudaSuccess;
}

int megartStandinPointerDevice(const void* ptr) {
  std::lock_guard<std::mutex> lock(g_mu);
  const char* p = static_cast<const char*>(ptr);
  auto it = g_allocations.upper_bound(p);
  if (it == g_allocations.begin()) return -1;
  --it;
  const std::size_t bytes = std::max<std::size_t>(it->second.first, 1);
  return p < it->first + bytes ? it->second.second : -1;
}

std::size_t megartStandinStreamPending(void* stream) {
  auto s = find_stream(static_cast<cudaStream_t>(stream));
  return s ? s->pending() : 0;
}

void megartStandinConfigure(unsigned long long seed, unsigned int max_delay_us) {
  g_seed = seed;
  g_max_delay_us = max_delay_us;
}

}  // extern "C"

extern "C" unsigned long long megartStandinLiveEvents() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_events.size();
}

extern "C" unsigned long long megartStandinEventsCreated() { return g_events_created.load(); }
