#include "core/thread_pool.h"

#include <algorithm>
#include <chrono>
#include <climits>

#include "core/cpu_features.h"
#include "core/error.h"
#include "core/interrupt.h"

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TF_CPU_RELAX() _mm_pause()
#else
#define TF_CPU_RELAX() ((void)0)
#endif

namespace tf {

namespace {
constexpr uint64_t kFieldMask = (uint64_t(1) << 24) - 1;
uint64_t pack(uint64_t gen, uint64_t next, uint64_t count) { return (gen << 48) | (next << 24) | count; }

// A bounded wait: a lost wake-up (there should be none) costs at most the timeout, never a hang.
constexpr long kWaitTimeoutNs = 100 * 1000 * 1000;

void wait_while_equal(std::atomic<uint32_t>& word, uint32_t expected) {
#if defined(__linux__)
  const timespec ts{0, kWaitTimeoutNs};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, &ts, nullptr, 0);
#else
  if (word.load(std::memory_order_acquire) == expected) std::this_thread::sleep_for(std::chrono::microseconds(50));
#endif
}

void wake(std::atomic<uint32_t>& word, int count) {
#if defined(__linux__)
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, count, nullptr, nullptr, 0);
#else
  (void)word;
  (void)count;
#endif
}

using Clock = std::chrono::steady_clock;

// Polls `done()` for about `spin_us`, yielding now and then so a descheduled thread that
// holds the work can run; returns whether it became true.
template <typename Done>
bool spin_until(Done done, int spin_us) {
  if (spin_us <= 0) return done();
  const auto until = Clock::now() + std::chrono::microseconds(spin_us);
  for (uint32_t i = 1;; ++i) {
    if (done()) return true;
    TF_CPU_RELAX();
    if ((i & 255) == 0) {
      if (Clock::now() >= until) return done();
      std::this_thread::yield();
    }
  }
}
}  // namespace

ThreadPool::ThreadPool(int n_threads, int spin_us) : n_threads_(std::max(1, n_threads)) {
  // Spinning only pays while every thread has a CPU of its own; oversubscribed, a spinning
  // thread takes the CPU from one that holds work, so idle threads sleep at once.
  spin_us_ = spin_us >= 0 ? spin_us : (n_threads_ <= usable_cpus() ? 200 : 0);
  threads_.reserve(size_t(n_threads_ - 1));
  for (int i = 1; i < n_threads_; ++i) threads_.emplace_back([this, i] { worker(i); });
}

ThreadPool::~ThreadPool() {
  stop_.store(true, std::memory_order_seq_cst);
  job_seq_.fetch_add(1, std::memory_order_seq_cst);
  wake(job_seq_, INT_MAX);
  for (auto& t : threads_) t.join();
}

bool ThreadPool::claim(int64_t& chunk) {
  uint64_t s = state_.load(std::memory_order_acquire);
  for (;;) {
    const uint64_t next = (s >> 24) & kFieldMask, count = s & kFieldMask;
    if (next >= count) return false;
    if (state_.compare_exchange_weak(s, s + (uint64_t(1) << 24), std::memory_order_acq_rel,
                                     std::memory_order_acquire)) {
      chunk = int64_t(next);
      return true;
    }
  }
}

void ThreadPool::execute(int64_t chunk, int thread) {
  if (!cancel_.load(std::memory_order_relaxed)) {
    try {
      if (interruptible_.load(std::memory_order_relaxed)) check_interrupt();
      (*fn_)(first_ + chunk, thread);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mu_);
      if (!error_) error_ = std::current_exception();
      cancel_.store(true, std::memory_order_relaxed);
    }
  }
  // seq_cst pairs with the caller's caller_waiting_ store / done_ load (no lost wake-up).
  done_.fetch_add(1, std::memory_order_seq_cst);
  if (caller_waiting_.load(std::memory_order_seq_cst)) wake(done_, 1);
}

void ThreadPool::worker(int index) {
  for (;;) {
    const uint32_t seen = job_seq_.load(std::memory_order_acquire);
    if (stop_.load(std::memory_order_acquire)) return;
    int64_t chunk;
    while (claim(chunk)) execute(chunk, index);
    auto changed = [&] { return job_seq_.load(std::memory_order_acquire) != seen; };
    if (spin_until(changed, spin_us_)) continue;
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    if (job_seq_.load(std::memory_order_seq_cst) == seen) wait_while_equal(job_seq_, seen);
    sleepers_.fetch_sub(1, std::memory_order_seq_cst);
  }
}

void ThreadPool::run_batch(int64_t first, int64_t n_chunks) {
  first_ = first;
  done_.store(0, std::memory_order_relaxed);
  const uint64_t gen = ((state_.load(std::memory_order_relaxed) >> 48) + 1) & 0xffff;
  state_.store(pack(gen, 0, uint64_t(n_chunks)), std::memory_order_release);
  job_seq_.fetch_add(1, std::memory_order_seq_cst);
  const int sleeping = sleepers_.load(std::memory_order_seq_cst);
  // Wake only as many sleepers as there are chunks for them to take.
  if (sleeping > 0) wake(job_seq_, int(std::min<int64_t>(sleeping, n_chunks - 1)));
  int64_t chunk;
  while (claim(chunk)) execute(chunk, 0);
  const uint32_t n = uint32_t(n_chunks);
  auto finished = [&] { return done_.load(std::memory_order_acquire) == n; };
  if (spin_until(finished, spin_us_ > 0 ? spin_us_ : 20)) return;
  for (;;) {
    caller_waiting_.store(true, std::memory_order_seq_cst);
    const uint32_t d = done_.load(std::memory_order_seq_cst);
    if (d != n) wait_while_equal(done_, d);
    caller_waiting_.store(false, std::memory_order_relaxed);
    if (finished()) return;
  }
}

void ThreadPool::run_chunks(int64_t n_chunks, const std::function<void(int64_t, int)>& fn) {
  if (n_chunks <= 0) return;
  const bool interruptible = interruptible_.load(std::memory_order_relaxed);
  if (n_threads_ == 1 || n_chunks == 1) {
    for (int64_t c = 0; c < n_chunks; ++c) {
      if (interruptible) check_interrupt();
      fn(c, 0);
    }
    return;
  }
  if (busy_.exchange(true, std::memory_order_acquire))
    fail(ErrorKind::Runtime, "thread pool: a second thread started work while a job was running; "
                             "calls into one engine must not overlap");
  struct Release {
    std::atomic<bool>& flag;
    ~Release() { flag.store(false, std::memory_order_release); }
  } release{busy_};
  fn_ = &fn;
  cancel_.store(false, std::memory_order_relaxed);
  for (int64_t first = 0; first < n_chunks && !cancel_.load(std::memory_order_relaxed); first += kMaxChunks)
    run_batch(first, std::min(kMaxChunks, n_chunks - first));
  fn_ = nullptr;
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(error_mu_);
    std::swap(error, error_);
  }
  if (error) std::rethrow_exception(error);
}

void ThreadPool::parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  const int64_t units = (n + grain - 1) / grain;
  const int64_t chunks = std::min<int64_t>(units, int64_t(n_threads_) * kChunksPerThread);
  if (n_threads_ == 1 || chunks == 1) {
    if (interruptible_.load(std::memory_order_relaxed)) check_interrupt();
    fn(0, n);
    return;
  }
  // Chunk c covers units [c * units / chunks, (c + 1) * units / chunks): sizes differ by at most one unit.
  run_chunks(chunks, [&](int64_t c, int) {
    const int64_t b = std::min(n, (c * units / chunks) * grain);
    const int64_t e = std::min(n, ((c + 1) * units / chunks) * grain);
    if (b < e) fn(b, e);
  });
}

}  // namespace tf
