// Internal seam between the shared collective algorithm (group.cpp) and a transport (TCP in
// tcp_transport.cpp; ibverbs later). A transport owns one link per "rail" to the single peer
// and moves bytes on them without blocking; the algorithm decides what goes on which rail,
// when, and what to re-send after a rail is lost. Not part of the public API.
//
// Contract for implementations:
//   * send_some / recv_some never block and never raise SIGPIPE. They return the number of
//     bytes moved (0 = would block). On a link error or EOF they mark the rail down (with a
//     reason) and return -1; a down rail stays down.
//   * wait() blocks until a rail of interest is ready, the timeout passes, or a rail fails.
//   * fail_rail() takes a rail down on purpose (protocol error, stall, test hook); the peer
//     must notice (EOF/reset) on its side of that rail.
#pragma once
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/group.h"

namespace tf::comm {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

inline Deadline deadline_after(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(seconds));
}

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;
  virtual int num_rails() const = 0;
  virtual bool up(int rail) const = 0;
  virtual std::string down_reason(int rail) const = 0;
  virtual std::string local_addr(int rail) const = 0;
  virtual std::string peer_addr(int rail) const = 0;

  // Gather-send of a header piece and a payload piece (either may be empty), in that order.
  virtual long send_some(int rail, const void* head, size_t head_len, const void* body,
                         size_t body_len) = 0;
  virtual long recv_some(int rail, void* dst, size_t len) = 0;

  // want_rx / want_tx: one flag per rail. ready_rx / ready_tx are filled (resized to
  // num_rails()). Returns false on timeout with nothing ready.
  virtual bool wait(const std::vector<uint8_t>& want_rx, const std::vector<uint8_t>& want_tx,
                    int timeout_ms, std::vector<uint8_t>& ready_rx,
                    std::vector<uint8_t>& ready_tx) = 0;

  virtual void fail_rail(int rail, const std::string& why) = 0;
};

// Blocking, deadline-bounded byte stream to the peer used during setup only (handshake and
// the exchange of per-rail connection details). Always TCP, whatever the data transport.
constexpr size_t kMaxBootMsg = size_t(1) << 20;

// Setup (bootstrap and rail connection) waits poll in slices of at most 50 ms and call
// tf::check_interrupt() between them, so Ctrl-C ends connection setup promptly. Collectives
// never check, except broadcast_idle() before its first byte (group.h).
class Bootstrap {
 public:
  virtual ~Bootstrap() = default;
  // Length-prefixed message; throws tf::Error("peer lost: ...") on EOF/error/deadline, and
  // when the announced length exceeds max_len (before reading or allocating the body).
  virtual void send_msg(const std::string& msg, Deadline dl) = 0;
  virtual std::string recv_msg(Deadline dl, size_t max_len = kMaxBootMsg) = 0;
  // The peer's address as seen when the link was made (still valid after it failed).
  virtual std::string peer_addr() const = 0;
  // Local IP of the bootstrap link: the address the peer reached us on (default rail).
  virtual std::string local_ip() const = 0;
  // Safe from another thread: shuts the link down, so a send/recv waiting on it fails at once
  // ("peer lost"). The object stays valid (and must still be destroyed) afterwards.
  virtual void abort() = 0;
};

// Rank 0's bootstrap socket. It hands out every incoming connection as a candidate; the
// caller (Group::create) runs the handshake on each, several at once, and keeps accepting
// until one passes, so a stray, hostile or silent connection never takes the peer's place.
class BootstrapListener {
 public:
  virtual ~BootstrapListener() = default;
  // The next connection, or null once dl passes without one.
  virtual std::unique_ptr<Bootstrap> accept(Deadline dl) = 0;
  virtual std::string addr() const = 0;
};

// Connections refused while waiting for the peer, on stderr: the first kMaxRejectLogs one by
// one, then at most one summary line per kRejectSummarySeconds and a last one when the wait
// ends, so a flood neither fills the log nor goes unseen. Not thread-safe.
class RejectLog {
 public:
  static constexpr int kMaxRejectLogs = 20;
  static constexpr double kRejectSummarySeconds = 10.0;
  // where: "bootstrap address HOST:PORT"; waiting_for: the peer's name.
  RejectLog(std::string where, std::string waiting_for);
  ~RejectLog() { finish(); }
  // still_waiting: the wait goes on (said in the line); false for connections closed after it.
  void reject(const std::string& from, const std::string& why, bool still_waiting = true);
  void tick();    // prints the summary when one is due
  void finish();  // summarises whatever is not logged yet
  int count() const { return count_; }
  // "IP:PORT (why)" of the latest rejection.
  const std::string& last() const { return last_; }

 private:
  void summarise();
  std::string where_, waiting_for_, last_, last_from_, last_why_;
  int count_ = 0, unlogged_ = 0;
  Clock::time_point last_line_{};
};

// Rank 0: binds and listens on opts.addr (throws at once if it cannot).
std::unique_ptr<BootstrapListener> tcp_bootstrap_listen(const GroupOptions& opts);
// Rank 1: connects to rank 0 at opts.addr, retrying until dl.
std::unique_ptr<Bootstrap> tcp_bootstrap_connect(const GroupOptions& opts, Deadline dl);

// Connects the rails over TCP. n_rails: agreed count (after the handshake). Rank 0 listens on
// each of its rail addresses and tells the peer the ports over `boot`; rank 1 binds each
// socket to its own rail address and connects.
std::unique_ptr<Transport> tcp_transport(const GroupOptions& opts, int n_rails, Bootstrap& boot,
                                         Deadline dl);

}  // namespace tf::comm
