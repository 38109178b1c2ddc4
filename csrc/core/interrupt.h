// Cooperative cancellation of long native work (Ctrl-C). While an InterruptScope is alive,
// SIGINT raises a process-wide flag and is still passed on to the previous handler (Python's,
// which then raises KeyboardInterrupt when the call returns). Long loops call
// check_interrupt() at cheap points (thread-pool chunks, layers, comm waits, tensor loads);
// it throws Error(ErrorKind::Interrupted), which the bindings turn into KeyboardInterrupt.
#pragma once

namespace tf {

// True once SIGINT arrived inside a scope (or request_interrupt() was called).
bool interrupt_requested();
// Throws Error(ErrorKind::Interrupted) when interrupt_requested().
void check_interrupt();
// Async-signal-safe; also usable from tests and other threads.
void request_interrupt();

// Scopes nest and may be alive on several threads at once: the first one installs the
// SIGINT hook and clears a stale flag, the last one restores the previous handler.
class InterruptScope {
 public:
  InterruptScope();
  ~InterruptScope();
  InterruptScope(const InterruptScope&) = delete;
  InterruptScope& operator=(const InterruptScope&) = delete;
};

}  // namespace tf
