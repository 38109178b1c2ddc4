#include "gguf/mapping_guard.h"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <mutex>

namespace tf::gguf_guard {
namespace {

// Fixed slots, read lock-free by the handler (which may run on any thread, at any time).
constexpr int kSlots = 256;
struct Slot {
  std::atomic<uintptr_t> begin{0}, end{0};
  std::atomic<int> lost{0};
};
Slot g_slots[kSlots];
std::atomic<uint64_t> g_faults{0};
uintptr_t g_page = 4096;
struct sigaction g_prev {};
std::mutex g_mu;  // registration and (re)installation; never taken by the handler

void on_sigbus(int sig, siginfo_t* info, void* ctx) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(info ? info->si_addr : nullptr);
  if (info && info->si_code == BUS_ADRERR) {
    for (Slot& s : g_slots) {
      const uintptr_t b = s.begin.load(std::memory_order_acquire);
      const uintptr_t e = s.end.load(std::memory_order_acquire);
      if (b == 0 || addr < b || addr >= e) continue;
      // Everything from the faulting page on lies past the file's new end too: zeros there,
      // so the interrupted read (and any later one) completes.
      const uintptr_t from = addr & ~(g_page - 1);
      void* m = mmap(reinterpret_cast<void*>(from), e - from, PROT_READ,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
      if (m != MAP_FAILED) {
        s.lost.store(1, std::memory_order_release);
        g_faults.fetch_add(1, std::memory_order_relaxed);
        return;
      }
      break;
    }
  }
  // Not a model mapping: whatever was there before us.
  if (g_prev.sa_flags & SA_SIGINFO) {
    if (g_prev.sa_sigaction) {
      g_prev.sa_sigaction(sig, info, ctx);
      return;
    }
  } else if (g_prev.sa_handler != SIG_DFL && g_prev.sa_handler != SIG_IGN && g_prev.sa_handler) {
    g_prev.sa_handler(sig);
    return;
  }
  // The default action: returning re-runs the faulting instruction, which now terminates
  // the process as if no handler had been installed.
  signal(sig, SIG_DFL);
}

// Installs the handler unless it is the current one (something such as Python's
// faulthandler may have replaced it since; we then chain to that).
void ensure_installed() {
  struct sigaction cur {};
  if (sigaction(SIGBUS, nullptr, &cur) != 0) return;
  if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_sigbus) return;
  struct sigaction sa {};
  sa.sa_sigaction = on_sigbus;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;
  sigemptyset(&sa.sa_mask);
  const long page = sysconf(_SC_PAGESIZE);
  if (page > 0) g_page = static_cast<uintptr_t>(page);
  struct sigaction prev {};
  if (sigaction(SIGBUS, &sa, &prev) == 0) g_prev = prev;
}

}  // namespace

int register_mapping(const void* base, size_t size) {
  if (!base || size == 0) return -1;
  std::lock_guard<std::mutex> lock(g_mu);
  ensure_installed();
  for (int i = 0; i < kSlots; ++i) {
    Slot& s = g_slots[i];
    if (s.begin.load(std::memory_order_relaxed) != 0) continue;
    const uintptr_t b = reinterpret_cast<uintptr_t>(base);
    s.lost.store(0, std::memory_order_relaxed);
    s.end.store(b + size, std::memory_order_release);
    s.begin.store(b, std::memory_order_release);
    return i;
  }
  return -1;
}

void unregister_mapping(int slot) {
  if (slot < 0 || slot >= kSlots) return;
  std::lock_guard<std::mutex> lock(g_mu);
  g_slots[slot].begin.store(0, std::memory_order_release);
  g_slots[slot].end.store(0, std::memory_order_release);
}

bool mapping_lost(int slot) {
  return slot >= 0 && slot < kSlots && g_slots[slot].lost.load(std::memory_order_acquire) != 0;
}

uint64_t faults_handled() { return g_faults.load(std::memory_order_relaxed); }

}  // namespace tf::gguf_guard
