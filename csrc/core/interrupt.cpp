#include "core/interrupt.h"

#include <atomic>
#include <csignal>
#include <mutex>

#include "core/error.h"

namespace tf {

namespace {
std::atomic<bool> g_flag{false};
std::mutex g_mu;
int g_depth = 0;
struct sigaction g_previous;

void on_sigint(int sig, siginfo_t* info, void* ctx) {
  g_flag.store(true, std::memory_order_relaxed);
  // Chain to whoever handled SIGINT before us (Python records the signal and raises
  // KeyboardInterrupt once the native call returns).
  if (g_previous.sa_flags & SA_SIGINFO) {
    if (g_previous.sa_sigaction) g_previous.sa_sigaction(sig, info, ctx);
  } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN &&
             g_previous.sa_handler != nullptr) {
    g_previous.sa_handler(sig);
  }
}
}  // namespace

bool interrupt_requested() { return g_flag.load(std::memory_order_relaxed); }

void check_interrupt() {
  if (g_flag.load(std::memory_order_relaxed)) throw Error(ErrorKind::Interrupted, "interrupted");
}

void request_interrupt() { g_flag.store(true, std::memory_order_relaxed); }

InterruptScope::InterruptScope() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_depth++ > 0) return;
  g_flag.store(false, std::memory_order_relaxed);
  struct sigaction sa{};
  sa.sa_sigaction = on_sigint;
  sa.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, &g_previous);
  if (!(g_previous.sa_flags & SA_SIGINFO) && g_previous.sa_handler == SIG_IGN) {
    sigaction(SIGINT, &g_previous, nullptr);  // SIGINT is ignored on purpose: leave it so
  }
}

InterruptScope::~InterruptScope() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (--g_depth > 0) return;
  struct sigaction current;
  sigaction(SIGINT, nullptr, &current);
  if ((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_sigint) sigaction(SIGINT, &g_previous, nullptr);
  g_flag.store(false, std::memory_order_relaxed);
}

}  // namespace tf
