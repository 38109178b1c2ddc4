// A fixed pool of worker threads for data-parallel kernels, built to degrade gracefully when
// the machine is busy or oversubscribed (more threads than usable CPUs):
// - work is cut into more chunks than threads and chunks are claimed dynamically, so a
//   descheduled thread delays only the chunk it holds, never a whole static share;
// - the calling thread claims chunks too (a pool of size 1 runs inline);
// - idle workers spin only briefly (and not at all when oversubscribed), then block on a
//   futex, so they never steal the CPU from the threads doing the work;
// - an exception thrown by a chunk on any thread is captured, the remaining chunks are
//   skipped, and it is re-thrown on the caller (never std::terminate);
// - when interruptible, chunks check tf::check_interrupt() so Ctrl-C ends long work.
#pragma once
#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace tf {

class ThreadPool {
 public:
  // n_threads includes the caller. spin_us: how long idle workers poll for the next job before
  // sleeping; < 0 picks it from the machine (brief when n_threads <= usable CPUs, else 0).
  explicit ThreadPool(int n_threads, int spin_us = -1);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }
  // Whether chunks poll tf::check_interrupt() (an interrupted job throws Interrupted).
  void set_interruptible(bool on) { interruptible_.store(on, std::memory_order_relaxed); }

  // fn(chunk, thread) once for every chunk in [0, n_chunks), in any order and on any thread;
  // `thread` in [0, size()) names the executing thread (0 = caller) for per-thread scratch.
  // Returns when every chunk has finished; re-throws the first exception a chunk threw.
  // One caller at a time: a second thread calling while a job runs gets an error.
  void run_chunks(int64_t n_chunks, const std::function<void(int64_t, int)>& fn);

  // fn(begin, end) over [0, n) in chunks whose boundaries are multiples of `grain`; about
  // kChunksPerThread chunks per thread so that uneven progress evens out.
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

  static constexpr int kChunksPerThread = 4;
  // Chunk counts per job are packed into 24 bits; run_chunks splits larger jobs itself.
  static constexpr int64_t kMaxChunks = (int64_t(1) << 24) - 1;

 private:
  void worker(int index);
  bool claim(int64_t& chunk);
  void execute(int64_t chunk, int thread);
  void run_batch(int64_t first, int64_t n_chunks);

  int n_threads_;
  int spin_us_;
  std::vector<std::thread> threads_;
  // The current job. Workers read it only after claiming one of its chunks, and the caller
  // cannot replace it before every claimed chunk finished, so the reads never race.
  const std::function<void(int64_t, int)>* fn_ = nullptr;
  int64_t first_ = 0;  // chunk index offset of the current batch
  // generation (16 bits) | next chunk (24) | chunk count (24): one CAS both claims a chunk
  // and proves the claim belongs to the job the worker saw.
  std::atomic<uint64_t> state_{0};
  std::atomic<uint32_t> done_{0};      // chunks finished in the current job (futex word)
  std::atomic<uint32_t> job_seq_{0};   // bumped per job; idle workers sleep on it (futex word)
  std::atomic<int> sleepers_{0};
  std::atomic<bool> caller_waiting_{false};
  std::atomic<bool> cancel_{false};    // a chunk failed: skip the rest
  std::atomic<bool> stop_{false};
  std::atomic<bool> interruptible_{false};
  std::atomic<bool> busy_{false};      // a job is running (the pool serves one caller at a time)
  std::mutex error_mu_;
  std::exception_ptr error_;
};

}  // namespace tf
