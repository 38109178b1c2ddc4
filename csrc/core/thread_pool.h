// A fixed pool of worker threads for data-parallel kernels. parallel_for splits [0, n) into
// contiguous chunks, one per thread; the calling thread takes chunk 0, so a pool of size 1
// runs inline with no synchronisation. Workers spin briefly before sleeping: decode issues
// hundreds of short parallel sections per token and a futex wake each time costs too much.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace tf {

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }

  // fn(thread_index, n_threads): each thread decides its own share of the work.
  void run(const std::function<void(int, int)>& fn);

  // fn(begin, end) on contiguous chunks of [0, n), chunk boundaries multiples of `grain`.
  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

 private:
  void worker(int index);

  int n_threads_;
  std::vector<std::thread> threads_;
  const std::function<void(int, int)>* job_ = nullptr;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<int> sleepers_{0};
};

}  // namespace tf
