// TCP transport: a bootstrap link (setup only) and one non-blocking TCP connection per rail,
// each bound to its own local address. All waits go through poll() with a deadline; sends use
// MSG_NOSIGNAL so a lost peer is an error code, never SIGPIPE.
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <random>
#include <sstream>
#include <thread>

#include "comm/transport.h"
#include "core/error.h"
#include "core/interrupt.h"

namespace tf::comm {
namespace {

constexpr uint32_t kRailHelloMagic = 0x54465231;  // "TFR1"
// How long a connection on a rail port may take to identify itself before it is dropped.
constexpr double kRailHelloSeconds = 3.0;

[[noreturn]] void peer_lost(const std::string& what) {
  fail(ErrorKind::Runtime, "peer lost: ", what);
}

std::string errstr(int e) { return std::strerror(e); }

int remaining_ms(Deadline dl) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(dl - Clock::now());
  if (left.count() <= 0) return 0;
  return static_cast<int>(std::min<int64_t>(left.count(), 1 << 30));
}

// One setup wait: at most 50 ms, then a Ctrl-C check (see transport.h).
int poll_slice(pollfd* p, int n, Deadline dl) {
  const int rc = ::poll(p, nfds_t(n), std::min(remaining_ms(dl), 50));
  const int err = errno;
  check_interrupt();
  errno = err;
  return rc;
}

// RAII file descriptor.
struct Fd {
  int fd = -1;
  Fd() = default;
  explicit Fd(int f) : fd(f) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  Fd(Fd&& o) noexcept : fd(o.fd) { o.fd = -1; }
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd = o.fd;
      o.fd = -1;
    }
    return *this;
  }
  ~Fd() { reset(); }
  void reset() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
};

// "HOST:PORT" -> (host, port). HOST may be a name or an IPv4 address.
std::pair<std::string, int> split_host_port(const std::string& addr) {
  const auto colon = addr.rfind(':');
  TF_CHECK(colon != std::string::npos && colon > 0 && colon + 1 < addr.size(),
           "comm address must be HOST:PORT, got '", addr, "'");
  const std::string host = addr.substr(0, colon), port_s = addr.substr(colon + 1);
  char* end = nullptr;
  const long port = std::strtol(port_s.c_str(), &end, 10);
  TF_CHECK(end && *end == '\0' && port >= 0 && port <= 65535, "bad port in comm address '",
           addr, "'");
  return {host, static_cast<int>(port)};
}

sockaddr_in resolve(const std::string& host, int port) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  if (host.empty() || host == "*") {
    sa.sin_addr.s_addr = htonl(INADDR_ANY);
    return sa;
  }
  if (inet_pton(AF_INET, host.c_str(), &sa.sin_addr) == 1) return sa;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  TF_CHECK(rc == 0 && res, "cannot resolve comm host '", host, "': ", gai_strerror(rc));
  sa.sin_addr = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
  freeaddrinfo(res);
  return sa;
}

std::string to_string(const sockaddr_in& sa) {
  char buf[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &sa.sin_addr, buf, sizeof buf);
  return std::string(buf) + ":" + std::to_string(ntohs(sa.sin_port));
}

std::string ip_of(const sockaddr_in& sa) {
  char buf[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &sa.sin_addr, buf, sizeof buf);
  return buf;
}

sockaddr_in local_of(int fd) {
  sockaddr_in sa{};
  socklen_t len = sizeof sa;
  getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  return sa;
}

void set_nonblocking(int fd) {
  const int fl = fcntl(fd, F_GETFL, 0);
  fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

// Socket buffer size for rails: TF_COMM_SOCKBUF bytes (0 = leave kernel autotuning alone).
int sockbuf_bytes() {
  if (const char* e = std::getenv("TF_COMM_SOCKBUF")) return std::max(0, std::atoi(e));
  return 4 << 20;
}

// How long sent data may stay unacknowledged on a rail before the kernel fails the socket
// (TCP_USER_TIMEOUT): half the group's timeout, so a rail whose link died silently errors
// out and the algorithm re-sends on the other rails before the peer counts as lost.
int g_rail_user_timeout_ms = 0;

void tune_socket(int fd, bool rail) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (!rail) return;
  if (g_rail_user_timeout_ms > 0)
    setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &g_rail_user_timeout_ms, sizeof g_rail_user_timeout_ms);
  const int want = sockbuf_bytes();
  if (want <= 0) return;
  // Privileged processes may exceed net.core.[rw]mem_max; otherwise the kernel clamps.
  if (setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &want, sizeof want) != 0)
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &want, sizeof want);
  if (setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &want, sizeof want) != 0)
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &want, sizeof want);
}

Fd make_socket(bool rail) {
  Fd s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (s.fd < 0) fail(ErrorKind::Runtime, "socket(): ", errstr(errno));
  tune_socket(s.fd, rail);
  return s;
}

Fd listen_on(const sockaddr_in& sa, bool rail, const std::string& what) {
  Fd s = make_socket(rail);
  int one = 1;
  setsockopt(s.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(s.fd, reinterpret_cast<const sockaddr*>(&sa), sizeof sa) != 0)
    fail(ErrorKind::Runtime, "cannot listen on ", what, " (", to_string(sa), "): ",
         errstr(errno));
  // A deep backlog: a burst of strays must not crowd out the peer's SYN while they are accepted.
  if (::listen(s.fd, 128) != 0)
    fail(ErrorKind::Runtime, "listen() on ", to_string(sa), ": ", errstr(errno));
  set_nonblocking(s.fd);
  return s;
}

// One waiting connection of a non-blocking listener (non-blocking itself), or an invalid Fd
// when none is waiting. `peer` receives its address, taken from accept itself so it stays
// right even after the connection failed.
Fd accept_now(int lfd, const std::string& what, sockaddr_in* peer) {
  for (;;) {
    sockaddr_in from{};
    socklen_t len = sizeof from;
    Fd c(::accept4(lfd, reinterpret_cast<sockaddr*>(&from), &len, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (c.fd >= 0) {
      *peer = from;
      return c;
    }
    // A connection that died in the backlog: try the next one.
    if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO || errno == ENETDOWN ||
        errno == EHOSTUNREACH || errno == ENETUNREACH)
      continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return Fd();
    fail(ErrorKind::Runtime, "accept() on ", what, ": ", errstr(errno));
  }
}

// Non-blocking connect with deadline. Returns an invalid Fd (and sets err) on a retryable
// failure; throws on deadline.
Fd try_connect(const sockaddr_in& to, const sockaddr_in* from, bool rail, Deadline dl,
               std::string& err) {
  Fd s = make_socket(rail);
  if (from) {
    int one = 1;
    setsockopt(s.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(s.fd, reinterpret_cast<const sockaddr*>(from), sizeof *from) != 0)
      fail(ErrorKind::Runtime, "cannot bind rail socket to local address ", ip_of(*from), ": ",
           errstr(errno));
  }
  set_nonblocking(s.fd);
  if (::connect(s.fd, reinterpret_cast<const sockaddr*>(&to), sizeof to) == 0) return s;
  if (errno != EINPROGRESS) {
    err = errstr(errno);
    return Fd();
  }
  const Deadline attempt = std::min(dl, Clock::now() + std::chrono::seconds(1));
  for (;;) {
    pollfd p{s.fd, POLLOUT, 0};
    const int rc = poll_slice(&p, 1, attempt);
    if (rc < 0 && errno == EINTR) continue;
    if (rc == 0 && Clock::now() < attempt) continue;
    if (rc <= 0) {
      err = "connect timed out";
      return Fd();
    }
    int soerr = 0;
    socklen_t len = sizeof soerr;
    getsockopt(s.fd, SOL_SOCKET, SO_ERROR, &soerr, &len);
    if (soerr != 0) {
      err = errstr(soerr);
      return Fd();
    }
    return s;
  }
}

Fd connect_retry(const sockaddr_in& to, const sockaddr_in* from, bool rail, Deadline dl,
                 const std::string& what) {
  std::string err = "no attempt";
  for (;;) {
    Fd s = try_connect(to, from, rail, dl, err);
    if (s.fd >= 0) return s;
    if (Clock::now() >= dl)
      fail(ErrorKind::Runtime, "peer lost: could not connect to ", what, " at ", to_string(to),
           " before the timeout (", err, "); is it running and listening there?");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    check_interrupt();
  }
}

void send_all(int fd, const void* p, size_t n, Deadline dl, const std::string& what) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t k = ::send(fd, c, n, MSG_NOSIGNAL);
    if (k > 0) {
      c += k;
      n -= static_cast<size_t>(k);
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK) peer_lost(what + ": " + errstr(errno));
    pollfd pf{fd, POLLOUT, 0};
    if (remaining_ms(dl) == 0) peer_lost(what + ": timed out");
    poll_slice(&pf, 1, dl);
  }
}

void recv_all(int fd, void* p, size_t n, Deadline dl, const std::string& what) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t k = ::recv(fd, c, n, 0);
    if (k > 0) {
      c += k;
      n -= static_cast<size_t>(k);
      continue;
    }
    if (k == 0) peer_lost(what + ": connection closed by peer");
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) peer_lost(what + ": " + errstr(errno));
    pollfd pf{fd, POLLIN, 0};
    if (remaining_ms(dl) == 0) peer_lost(what + ": timed out");
    poll_slice(&pf, 1, dl);
  }
}

class TcpBootstrap final : public Bootstrap {
 public:
  // The addresses are taken now: getpeername fails once the peer reset the connection.
  TcpBootstrap(Fd s, const sockaddr_in& peer)
      : s_(std::move(s)), peer_(to_string(peer)), local_ip_(ip_of(local_of(s_.fd))) {}
  void send_msg(const std::string& msg, Deadline dl) override {
    TF_CHECK(msg.size() <= kMaxBootMsg, "bootstrap message of ", msg.size(), " bytes is too long");
    const uint32_t n = static_cast<uint32_t>(msg.size());
    unsigned char len[4] = {uint8_t(n), uint8_t(n >> 8), uint8_t(n >> 16), uint8_t(n >> 24)};
    send_all(s_.fd, len, 4, dl, "bootstrap link to " + peer_);
    send_all(s_.fd, msg.data(), msg.size(), dl, "bootstrap link to " + peer_);
  }
  std::string recv_msg(Deadline dl, size_t max_len) override {
    unsigned char len[4];
    recv_all(s_.fd, len, 4, dl, "bootstrap link to " + peer_);
    const uint32_t n = uint32_t(len[0]) | uint32_t(len[1]) << 8 | uint32_t(len[2]) << 16 |
                       uint32_t(len[3]) << 24;
    if (n > std::min(max_len, kMaxBootMsg))
      fail(ErrorKind::Runtime, "bootstrap: peer at ", peer_,
           " is not a TensorFold comm group (bad message length ", n, ")");
    std::string msg(n, '\0');
    recv_all(s_.fd, msg.data(), n, dl, "bootstrap link to " + peer_);
    return msg;
  }
  std::string peer_addr() const override { return peer_; }
  std::string local_ip() const override { return local_ip_; }
  void abort() override { ::shutdown(s_.fd, SHUT_RDWR); }

 private:
  Fd s_;
  std::string peer_, local_ip_;
};

class TcpBootstrapListener final : public BootstrapListener {
 public:
  TcpBootstrapListener(Fd l, std::string addr) : l_(std::move(l)), addr_(std::move(addr)) {}
  std::unique_ptr<Bootstrap> accept(Deadline dl) override {
    for (;;) {
      sockaddr_in peer{};
      Fd c = accept_now(l_.fd, "bootstrap address " + addr_, &peer);
      if (c.fd >= 0) {
        tune_socket(c.fd, false);
        return std::make_unique<TcpBootstrap>(std::move(c), peer);
      }
      if (Clock::now() >= dl) return nullptr;
      pollfd p{l_.fd, POLLIN, 0};
      poll_slice(&p, 1, dl);
    }
  }
  std::string addr() const override { return addr_; }

 private:
  Fd l_;
  std::string addr_;
};

struct Rail {
  Fd fd;
  bool up = true;
  std::string local, peer, reason;
};

class TcpTransport final : public Transport {
 public:
  explicit TcpTransport(std::vector<Rail> rails) : rails_(std::move(rails)) {}

  // Graceful close: half-close each rail so everything queued (and a FIN) goes out, and keep
  // draining input until the peer's kernel has acknowledged our bytes (bounded wait). Closing
  // with unread input would make the kernel reset the connection and could drop the last
  // message the peer still needs.
  ~TcpTransport() override {
    for (auto& rl : rails_)
      if (rl.up) ::shutdown(rl.fd.fd, SHUT_WR);
    const Deadline dl = Clock::now() + std::chrono::milliseconds(500);
    char sink[16384];
    for (;;) {
      bool pending = false;
      std::vector<pollfd> pf;
      for (auto& rl : rails_) {
        if (!rl.up) continue;
        for (;;) {
          const ssize_t k = ::recv(rl.fd.fd, sink, sizeof sink, MSG_DONTWAIT);
          if (k > 0) continue;
          if (k < 0 && errno == EINTR) continue;
          break;
        }
        int outq = 0;
        if (::ioctl(rl.fd.fd, SIOCOUTQ, &outq) == 0 && outq > 0) {
          pending = true;
          pf.push_back({rl.fd.fd, POLLIN, 0});
        }
      }
      if (!pending || Clock::now() >= dl) break;
      ::poll(pf.data(), pf.size(), 5);
    }
  }
  const char* name() const override { return "tcp"; }
  int num_rails() const override { return static_cast<int>(rails_.size()); }
  bool up(int r) const override { return rails_[r].up; }
  std::string down_reason(int r) const override { return rails_[r].reason; }
  std::string local_addr(int r) const override { return rails_[r].local; }
  std::string peer_addr(int r) const override { return rails_[r].peer; }

  long send_some(int r, const void* head, size_t hn, const void* body, size_t bn) override {
    Rail& rl = rails_[r];
    if (!rl.up) return -1;
    iovec iov[2];
    int cnt = 0;
    if (hn) iov[cnt++] = {const_cast<void*>(head), hn};
    if (bn) iov[cnt++] = {const_cast<void*>(body), bn};
    if (cnt == 0) return 0;
    msghdr mh{};
    mh.msg_iov = iov;
    mh.msg_iovlen = cnt;
    for (;;) {
      const ssize_t k = ::sendmsg(rl.fd.fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k >= 0) return static_cast<long>(k);
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
      fail_rail(r, "send: " + errstr(errno));
      return -1;
    }
  }

  long recv_some(int r, void* dst, size_t len) override {
    Rail& rl = rails_[r];
    if (!rl.up) return -1;
    if (len == 0) return 0;
    for (;;) {
      const ssize_t k = ::recv(rl.fd.fd, dst, len, MSG_DONTWAIT);
      if (k > 0) return static_cast<long>(k);
      if (k == 0) {
        fail_rail(r, "connection closed by peer");
        return -1;
      }
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
      fail_rail(r, "recv: " + errstr(errno));
      return -1;
    }
  }

  bool wait(const std::vector<uint8_t>& want_rx, const std::vector<uint8_t>& want_tx,
            int timeout_ms, std::vector<uint8_t>& ready_rx,
            std::vector<uint8_t>& ready_tx) override {
    const int n = num_rails();
    ready_rx.assign(n, 0);
    ready_tx.assign(n, 0);
    pollfd pf[16];
    int idx[16];
    int cnt = 0;
    for (int r = 0; r < n && cnt < 16; ++r) {
      if (!rails_[r].up) continue;
      short ev = 0;
      if (want_rx[r]) ev |= POLLIN;
      if (want_tx[r]) ev |= POLLOUT;
      if (!ev) continue;
      pf[cnt] = {rails_[r].fd.fd, ev, 0};
      idx[cnt++] = r;
    }
    if (cnt == 0) {
      if (timeout_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(timeout_ms));
      return false;
    }
    const int rc = ::poll(pf, cnt, timeout_ms);
    if (rc <= 0) return false;
    for (int i = 0; i < cnt; ++i) {
      const short re = pf[i].revents;
      // Errors/hangups are reported as readiness so the caller's next I/O sees them.
      if (re & (POLLIN | POLLERR | POLLHUP | POLLNVAL)) ready_rx[idx[i]] = 1;
      if (re & (POLLOUT | POLLERR | POLLHUP | POLLNVAL)) ready_tx[idx[i]] = 1;
    }
    return true;
  }

  void fail_rail(int r, const std::string& why) override {
    Rail& rl = rails_[r];
    if (!rl.up) return;
    rl.up = false;
    rl.reason = why;
    if (rl.fd.fd >= 0) ::shutdown(rl.fd.fd, SHUT_RDWR);
    rl.fd.reset();
  }

 private:
  std::vector<Rail> rails_;
};

// The listening side of the rails: one poll over the listeners of the rails still missing and
// every connection that has not identified itself yet, whose 16-byte hellos are read without
// blocking. The first valid hello per rail wins; a connection that sends anything else, closes,
// or stays silent for kRailHelloSeconds is dropped, so no connection can stall the setup.
void accept_rails(const GroupOptions& opts, const std::vector<Fd>& listeners, uint64_t nonce, Deadline dl,
                  std::vector<Rail>& rails) {
  struct Candidate {
    Fd fd;
    sockaddr_in from{};
    int rail = 0;
    unsigned char hello[16];
    size_t got = 0;
    Deadline until;
    std::string why;  // set: drop it
    bool won = false;
  };
  constexpr size_t kMaxCandidates = 64;
  const int n_rails = static_cast<int>(listeners.size());
  std::deque<RejectLog> logs;  // one per rail; a deque never moves them
  for (int i = 0; i < n_rails; ++i)
    logs.emplace_back("rail " + std::to_string(i) + " (" + to_string(local_of(listeners[size_t(i)].fd)) + ")",
                      opts.peer_name);
  std::vector<Candidate> cands;  // oldest first
  std::vector<pollfd> pf;
  std::vector<int> pf_rail;  // the rail of each listener entry in pf
  int missing = n_rails;
  while (missing > 0) {
    const auto now = Clock::now();
    for (Candidate& c : cands)
      if (now >= c.until)
        c.why = "did not identify itself within " + std::to_string(int(kRailHelloSeconds)) + " s";
    // Settle the candidates: winners take their rail, the dropped are logged and closed.
    for (Candidate& c : cands) {
      if (c.won) {
        tune_socket(c.fd.fd, true);
        Rail& rl = rails[size_t(c.rail)];
        rl.local = to_string(local_of(c.fd.fd));
        rl.peer = to_string(c.from);
        rl.fd = std::move(c.fd);
        --missing;
      } else if (!c.why.empty()) {
        logs[size_t(c.rail)].reject(to_string(c.from), c.why);
      }
    }
    cands.erase(std::remove_if(cands.begin(), cands.end(), [](const Candidate& c) { return c.won || !c.why.empty(); }),
                cands.end());
    for (RejectLog& l : logs) l.tick();
    if (missing == 0) break;
    if (now >= dl) {
      int first = 0;
      while (rails[size_t(first)].fd.fd >= 0) ++first;
      peer_lost("timed out waiting for " + opts.peer_name + " to connect on rail " + std::to_string(first));
    }

    pf.clear();
    pf_rail.clear();
    for (int i = 0; i < n_rails; ++i)
      if (rails[size_t(i)].fd.fd < 0) {
        pf.push_back({listeners[size_t(i)].fd, POLLIN, 0});
        pf_rail.push_back(i);
      }
    const size_t n_listening = pf.size();
    for (const Candidate& c : cands) pf.push_back({c.fd.fd, POLLIN, 0});
    Deadline wake = dl;
    for (const Candidate& c : cands) wake = std::min(wake, c.until);
    if (poll_slice(pf.data(), static_cast<int>(pf.size()), wake) <= 0) continue;

    for (size_t j = 0; j < cands.size(); ++j) {
      Candidate& c = cands[j];
      if (!pf[n_listening + j].revents) continue;
      const ssize_t k = ::recv(c.fd.fd, c.hello + c.got, sizeof c.hello - c.got, MSG_DONTWAIT);
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
      if (k <= 0) {
        c.why = k == 0 ? "closed before identifying itself" : errstr(errno);
        continue;
      }
      c.got += size_t(k);
      if (c.got < sizeof c.hello) continue;
      uint64_t got_nonce;
      uint32_t magic, idx;
      std::memcpy(&got_nonce, c.hello, 8);
      std::memcpy(&magic, c.hello + 8, 4);
      std::memcpy(&idx, c.hello + 12, 4);
      if (magic != kRailHelloMagic || got_nonce != nonce || idx != uint32_t(c.rail))
        c.why = "not our peer's rail " + std::to_string(c.rail);
      else if (rails[size_t(c.rail)].fd.fd >= 0 ||
               std::any_of(cands.begin(), cands.end(), [&](const Candidate& o) { return o.won && o.rail == c.rail; }))
        c.why = "rail " + std::to_string(c.rail) + " is connected already";
      else
        c.won = true;
    }
    for (size_t j = 0; j < n_listening; ++j) {
      if (!pf[j].revents) continue;
      const int rail = pf_rail[j];
      for (;;) {
        Candidate c;
        c.fd = accept_now(listeners[size_t(rail)].fd, "rail " + std::to_string(rail), &c.from);
        if (c.fd.fd < 0) break;
        if (cands.size() >= kMaxCandidates) {  // the oldest has had the longest to speak
          logs[size_t(cands.front().rail)].reject(to_string(cands.front().from),
                                                  "dropped: too many connections waiting to identify themselves");
          cands.erase(cands.begin());
        }
        c.rail = rail;
        c.until = std::min(dl, Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                  std::chrono::duration<double>(kRailHelloSeconds)));
        cands.push_back(std::move(c));
      }
    }
  }
  for (const Candidate& c : cands)
    logs[size_t(c.rail)].reject(to_string(c.from), "closed: had not identified itself when the rails were up", false);
}

}  // namespace

std::unique_ptr<BootstrapListener> tcp_bootstrap_listen(const GroupOptions& opts) {
  const auto [host, port] = split_host_port(opts.addr);
  const sockaddr_in sa = resolve(host, port);
  Fd l = listen_on(sa, false, "bootstrap address " + opts.addr);
  return std::make_unique<TcpBootstrapListener>(std::move(l), opts.addr);
}

std::unique_ptr<Bootstrap> tcp_bootstrap_connect(const GroupOptions& opts, Deadline dl) {
  const auto [host, port] = split_host_port(opts.addr);
  TF_CHECK(port != 0, opts.self_name, " needs the port ", opts.peer_name, " listens on, got '", opts.addr, "'");
  const sockaddr_in sa = resolve(host, port);
  Fd c = connect_retry(sa, nullptr, false, dl, opts.peer_name);
  return std::make_unique<TcpBootstrap>(std::move(c), sa);
}

std::unique_ptr<Transport> tcp_transport(const GroupOptions& opts, int n_rails, Bootstrap& boot,
                                         Deadline dl) {
  g_rail_user_timeout_ms = static_cast<int>(std::max(500.0, opts.timeout_s * 500.0));
  std::vector<Rail> rails(static_cast<size_t>(n_rails));
  // A random nonce ties the rail connections to this bootstrap session.
  if (opts.rank == 0) {
    std::random_device rd;
    const uint64_t nonce = (uint64_t(rd()) << 32) ^ rd();
    std::vector<Fd> listeners;
    std::ostringstream plan;
    plan << nonce;
    for (int i = 0; i < n_rails; ++i) {
      const std::string ip = opts.rails.empty() ? boot.local_ip() : opts.rails[size_t(i)];
      const sockaddr_in sa = resolve(ip, 0);
      listeners.push_back(listen_on(sa, true, "rail " + std::to_string(i) + " address " + ip));
      plan << ' ' << to_string(local_of(listeners.back().fd));
    }
    boot.send_msg(plan.str(), dl);
    accept_rails(opts, listeners, nonce, dl, rails);
    boot.send_msg("rails-ok", dl);
  } else {
    std::istringstream plan(boot.recv_msg(dl));
    uint64_t nonce = 0;
    plan >> nonce;
    for (int i = 0; i < n_rails; ++i) {
      std::string ep;
      plan >> ep;
      if (ep.empty())
        fail(ErrorKind::Runtime, "bootstrap: ", opts.peer_name, " announced fewer than ", n_rails, " rails");
      const auto [h, p] = split_host_port(ep);
      const sockaddr_in to = resolve(h, p);
      sockaddr_in from{};
      const bool bind_local = !opts.rails.empty();
      if (bind_local) from = resolve(opts.rails[size_t(i)], 0);
      const std::string what = "rail " + std::to_string(i) + " of " + opts.peer_name;
      Fd c = connect_retry(to, bind_local ? &from : nullptr, true, dl, what);
      unsigned char hello[16];
      const uint32_t magic = kRailHelloMagic, idx = uint32_t(i);
      std::memcpy(hello, &nonce, 8);
      std::memcpy(hello + 8, &magic, 4);
      std::memcpy(hello + 12, &idx, 4);
      send_all(c.fd, hello, sizeof hello, dl, what);
      rails[size_t(i)].local = to_string(local_of(c.fd));
      rails[size_t(i)].peer = to_string(to);
      rails[size_t(i)].fd = std::move(c);
    }
    const std::string ok = boot.recv_msg(dl);
    if (ok != "rails-ok") fail(ErrorKind::Runtime, "bootstrap: ", opts.peer_name, " refused the rails: ", ok);
  }
  return std::make_unique<TcpTransport>(std::move(rails));
}

}  // namespace tf::comm
