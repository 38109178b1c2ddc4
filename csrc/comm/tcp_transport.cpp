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
  if (::listen(s.fd, 16) != 0)
    fail(ErrorKind::Runtime, "listen() on ", to_string(sa), ": ", errstr(errno));
  set_nonblocking(s.fd);
  return s;
}

// Accepts one connection; `peer` receives its address (taken from accept itself, so it stays
// right even after the connection failed).
Fd accept_one(int lfd, Deadline dl, const std::string& what, sockaddr_in* peer = nullptr) {
  for (;;) {
    pollfd p{lfd, POLLIN, 0};
    const int rc = poll_slice(&p, 1, dl);
    if (rc < 0 && errno == EINTR) continue;
    if (rc <= 0) {
      if (Clock::now() >= dl) peer_lost("timed out waiting for rank 1 to connect on " + what);
      continue;
    }
    sockaddr_in from{};
    socklen_t len = sizeof from;
    Fd c(::accept4(lfd, reinterpret_cast<sockaddr*>(&from), &len, SOCK_CLOEXEC));
    if (c.fd < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED ||
          errno == EPROTO || errno == ENETDOWN || errno == EHOSTUNREACH || errno == ENETUNREACH)
        continue;
      fail(ErrorKind::Runtime, "accept() on ", what, ": ", errstr(errno));
    }
    if (peer) *peer = from;
    set_nonblocking(c.fd);
    tune_socket(c.fd, true);
    return c;
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
           " before the timeout (", err, ")");
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

 private:
  Fd s_;
  std::string peer_, local_ip_;
};

class TcpBootstrapListener final : public BootstrapListener {
 public:
  TcpBootstrapListener(Fd l, std::string addr) : l_(std::move(l)), addr_(std::move(addr)) {}
  std::unique_ptr<Bootstrap> accept(Deadline dl) override {
    sockaddr_in peer{};
    Fd c = accept_one(l_.fd, dl, "bootstrap address " + addr_, &peer);
    tune_socket(c.fd, false);
    return std::make_unique<TcpBootstrap>(std::move(c), peer);
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

}  // namespace

std::unique_ptr<BootstrapListener> tcp_bootstrap_listen(const GroupOptions& opts) {
  const auto [host, port] = split_host_port(opts.addr);
  const sockaddr_in sa = resolve(host, port);
  Fd l = listen_on(sa, false, "bootstrap address " + opts.addr);
  return std::make_unique<TcpBootstrapListener>(std::move(l), opts.addr);
}

std::unique_ptr<Bootstrap> tcp_bootstrap_connect(const GroupOptions& opts, Deadline dl) {
  const auto [host, port] = split_host_port(opts.addr);
  TF_CHECK(port != 0, "rank ", opts.rank, " needs rank 0's port in addr, got '", opts.addr, "'");
  const sockaddr_in sa = resolve(host, port);
  Fd c = connect_retry(sa, nullptr, false, dl, "rank 0 (bootstrap)");
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
    for (int i = 0; i < n_rails; ++i) {
      const std::string what = "rail " + std::to_string(i);
      // Anything else that connects to the rail port is dropped; we keep waiting for the
      // peer's connection (it proves itself with the session nonce) until dl.
      for (;;) {
        sockaddr_in from{};
        Fd c = accept_one(listeners[size_t(i)].fd, dl, what, &from);
        unsigned char hello[16];
        std::string why;
        try {
          recv_all(c.fd, hello, sizeof hello,
                   std::min(dl, Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                    std::chrono::duration<double>(kRailHelloSeconds))),
                   what + " hello");
          uint64_t got_nonce;
          uint32_t magic, idx;
          std::memcpy(&got_nonce, hello, 8);
          std::memcpy(&magic, hello + 8, 4);
          std::memcpy(&idx, hello + 12, 4);
          if (magic != kRailHelloMagic || got_nonce != nonce || idx != uint32_t(i))
            why = "not our peer's rail " + std::to_string(i);
        } catch (const Error& e) {
          if (e.kind() == ErrorKind::Interrupted) throw;
          why = e.what();
        }
        if (!why.empty()) {
          std::fprintf(stderr, "tensorfold comm: dropped an unexpected connection on %s from %s (%s)\n",
                       what.c_str(), to_string(from).c_str(), why.c_str());
          continue;
        }
        tune_socket(c.fd, true);
        rails[size_t(i)].local = to_string(local_of(c.fd));
        rails[size_t(i)].peer = to_string(from);
        rails[size_t(i)].fd = std::move(c);
        break;
      }
    }
    boot.send_msg("rails-ok", dl);
  } else {
    std::istringstream plan(boot.recv_msg(dl));
    uint64_t nonce = 0;
    plan >> nonce;
    for (int i = 0; i < n_rails; ++i) {
      std::string ep;
      plan >> ep;
      if (ep.empty())
        fail(ErrorKind::Runtime, "bootstrap: rank 0 announced fewer than ", n_rails, " rails");
      const auto [h, p] = split_host_port(ep);
      const sockaddr_in to = resolve(h, p);
      sockaddr_in from{};
      const bool bind_local = !opts.rails.empty();
      if (bind_local) from = resolve(opts.rails[size_t(i)], 0);
      const std::string what = "rank 0's rail " + std::to_string(i);
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
    if (ok != "rails-ok") fail(ErrorKind::Runtime, "bootstrap: rank 0 refused the rails: ", ok);
  }
  return std::make_unique<TcpTransport>(std::move(rails));
}

}  // namespace tf::comm
