// ibverbs transport: one RC queue pair per rail, each on its own device/port/GID, moving the
// same byte stream the TCP transport moves. Thin by design: no collective logic here.
//
// Per rail and direction there is a ring of R bytes (R = min of both ranks' TF_IBV_RING):
//   * the receiver's ring is registered for remote write; the sender keeps a registered
//     staging ring of the same size and mirrors offsets (byte i of the stream lives at
//     i mod R on both sides).
//   * send_some copies into the staging ring and posts RDMA WRITE WITH IMMEDIATE to the same
//     offset of the peer's ring (never wrapping inside one write); immediate = bytes written
//     (network order). RC ordering makes each write land right after the previous one.
//   * the receiver learns of data from the receive completion (imm), recv_some copies out of
//     the ring and, every R/4 consumed bytes, returns credit: a small inline SEND carrying
//     the cumulative consumed-byte counter. The sender never has more than R bytes beyond
//     min(peer's consumed counter, its own locally completed writes) in flight.
//   * control SENDs also carry "rail taken down" / "closing" notices; both behave like a TCP
//     EOF: data already received stays readable, then the rail is reported down.
// Any failed or flushed completion marks the rail down with the status text and moves the QP
// to ERR. All waits busy-poll the CQs (yielding the CPU between polls) up to the deadline.
#include <arpa/inet.h>
#include <infiniband/verbs.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <thread>

#include "comm/ibverbs_transport.h"
#include "core/error.h"

namespace tf::comm {
namespace {

constexpr int kMaxSendWr = 256;
constexpr int kRecvSlots = 1024;
constexpr int kCtrlSlots = 8;          // concurrent control SENDs (and their buffers)
constexpr uint64_t kCtrlCredit = 1, kCtrlDown = 2, kCtrlClose = 3;
constexpr uint64_t kTypeShift = 62;
constexpr uint64_t kTypeData = 0, kTypeCtrl = 1, kTypeRecv = 2;
constexpr uint64_t kLowMask = (uint64_t(1) << kTypeShift) - 1;
constexpr uint64_t kNotifyBit = uint64_t(1) << 40;  // in a ctrl wr_id: the down/close notice

struct CtrlMsg {
  uint64_t kind;
  uint64_t value;
};
static_assert(sizeof(CtrlMsg) == 16, "control message is 16 bytes");

std::string errstr(int e) { return std::strerror(e); }

size_t ring_bytes_env() {
  size_t v = size_t(8) << 20;
  if (const char* e = std::getenv("TF_IBV_RING")) {
    const long long x = std::atoll(e);
    if (x > 0) v = static_cast<size_t>(x);
  }
  v = std::max<size_t>(v, size_t(64) << 10);
  v = std::min<size_t>(v, size_t(1) << 30);
  return (v + 4095) & ~size_t(4095);
}

int timeout_env() {
  if (const char* e = std::getenv("TF_IBV_TIMEOUT")) {
    const int x = std::atoi(e);
    if (x >= 1 && x <= 31) return x;
  }
  return 14;
}

int mtu_bytes(ibv_mtu m) {
  switch (m) {
    case IBV_MTU_256: return 256;
    case IBV_MTU_512: return 512;
    case IBV_MTU_1024: return 1024;
    case IBV_MTU_2048: return 2048;
    case IBV_MTU_4096: return 4096;
  }
  return 0;
}

const char* port_state_str(ibv_port_state s) {
  switch (s) {
    case IBV_PORT_DOWN: return "DOWN";
    case IBV_PORT_INIT: return "INIT";
    case IBV_PORT_ARMED: return "ARMED";
    case IBV_PORT_ACTIVE: return "ACTIVE";
    case IBV_PORT_ACTIVE_DEFER: return "ACTIVE_DEFER";
    default: return "NOP";
  }
}

std::string gid_hex(const ibv_gid& g) {
  char buf[48];
  const uint8_t* b = g.raw;
  std::snprintf(buf, sizeof buf, "%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x",
                b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12],
                b[13], b[14], b[15]);
  return buf;
}

bool parse_gid(const std::string& s, ibv_gid& g) {
  unsigned v[16];
  if (std::sscanf(s.c_str(), "%2x%2x:%2x%2x:%2x%2x:%2x%2x:%2x%2x:%2x%2x:%2x%2x:%2x%2x", &v[0], &v[1],
                  &v[2], &v[3], &v[4], &v[5], &v[6], &v[7], &v[8], &v[9], &v[10], &v[11], &v[12],
                  &v[13], &v[14], &v[15]) != 16)
    return false;
  for (int i = 0; i < 16; ++i) g.raw[i] = static_cast<uint8_t>(v[i]);
  return true;
}

bool gid_is_zero(const ibv_gid& g) {
  for (uint8_t b : g.raw)
    if (b) return false;
  return true;
}

// "A.B.C.D" when g is the IPv4-mapped GID ::ffff:A.B.C.D, else "".
std::string gid_ipv4(const ibv_gid& g) {
  for (int i = 0; i < 10; ++i)
    if (g.raw[i]) return "";
  if (g.raw[10] != 0xff || g.raw[11] != 0xff) return "";
  char buf[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, g.raw + 12, buf, sizeof buf);
  return buf;
}

const char* gid_type_str(uint32_t t) {
  switch (t) {
    case IBV_GID_TYPE_IB: return "IB";
    case IBV_GID_TYPE_ROCE_V1: return "RoCEv1";
    case IBV_GID_TYPE_ROCE_V2: return "RoCEv2";
    default: return "?";
  }
}

// ---- device list / contexts --------------------------------------------------------------
struct DevList {
  ibv_device** list = nullptr;
  int n = 0;
  DevList() {
    list = ibv_get_device_list(&n);
    if (!list) n = 0;
  }
  ~DevList() {
    if (list) ibv_free_device_list(list);
  }
  DevList(const DevList&) = delete;
  DevList& operator=(const DevList&) = delete;
};

struct Ctx {
  ibv_context* c = nullptr;
  explicit Ctx(ibv_device* d) : c(ibv_open_device(d)) {}
  ~Ctx() {
    if (c) ibv_close_device(c);
  }
  Ctx(const Ctx&) = delete;
  Ctx& operator=(const Ctx&) = delete;
};

struct GidEntry {
  int index;
  ibv_gid gid;
  uint32_t type;
};

// Valid GID entries of a port (ibv_query_gid_ex skips empty ones by failing).
std::vector<GidEntry> port_gids(ibv_context* c, int port, int tbl_len) {
  std::vector<GidEntry> out;
  for (int i = 0; i < tbl_len; ++i) {
    ibv_gid_entry e{};
    if (ibv_query_gid_ex(c, static_cast<uint32_t>(port), static_cast<uint32_t>(i), &e, 0) != 0) {
      // Older providers: fall back to the plain query (type unknown).
      ibv_gid g{};
      if (ibv_query_gid(c, static_cast<uint8_t>(port), i, &g) != 0 || gid_is_zero(g)) continue;
      out.push_back({i, g, 0xffffffffu});
      continue;
    }
    if (gid_is_zero(e.gid)) continue;
    out.push_back({i, e.gid, e.gid_type});
  }
  return out;
}

// Automatic GID choice for a port: RoCE v2 IPv4-mapped, then any RoCE v2, then the first.
int auto_gid_index(ibv_context* c, int port, const ibv_port_attr& pa) {
  if (pa.link_layer != IBV_LINK_LAYER_ETHERNET) return 0;
  const auto gids = port_gids(c, port, pa.gid_tbl_len);
  for (const auto& g : gids)
    if (g.type == IBV_GID_TYPE_ROCE_V2 && !gid_ipv4(g.gid).empty()) return g.index;
  for (const auto& g : gids)
    if (g.type == IBV_GID_TYPE_ROCE_V2) return g.index;
  for (const auto& g : gids)
    if (!gid_ipv4(g.gid).empty()) return g.index;
  return gids.empty() ? -1 : gids.front().index;
}

struct RailSpec {
  std::string dev;
  int port = 1;
  int gid_index = 0;
  std::string ip;  // when chosen by address
  std::string label() const {
    return dev + ":" + std::to_string(port) + (ip.empty() ? "" : "/" + ip) + "#gid" +
           std::to_string(gid_index);
  }
};

std::string known_devices(const DevList& dl) {
  std::string s;
  for (int i = 0; i < dl.n; ++i) s += (i ? ", " : "") + std::string(ibv_get_device_name(dl.list[i]));
  return s.empty() ? "none" : s;
}

// Finds the device/port/GID holding the IPv4-mapped GID of `ip`; false if none.
bool find_by_ipv4(const DevList& dl, const std::string& ip, RailSpec& out) {
  in_addr a{};
  if (inet_pton(AF_INET, ip.c_str(), &a) != 1) return false;
  bool found = false;
  bool found_v2 = false;
  for (int d = 0; d < dl.n && !found_v2; ++d) {
    Ctx ctx(dl.list[d]);
    if (!ctx.c) continue;
    ibv_device_attr da{};
    if (ibv_query_device(ctx.c, &da) != 0) continue;
    for (int p = 1; p <= da.phys_port_cnt && !found_v2; ++p) {
      ibv_port_attr pa{};
      if (ibv_query_port(ctx.c, static_cast<uint8_t>(p), &pa) != 0) continue;
      for (const auto& g : port_gids(ctx.c, p, pa.gid_tbl_len)) {
        if (gid_ipv4(g.gid) != ip) continue;
        const bool v2 = g.type == IBV_GID_TYPE_ROCE_V2;
        if (!found || (v2 && !found_v2)) {
          out.dev = ibv_get_device_name(dl.list[d]);
          out.port = p;
          out.gid_index = g.index;
          out.ip = ip;
          found = true;
          found_v2 = v2;
        }
        if (found_v2) break;
      }
    }
  }
  return found;
}

// First active port of any device with a usable GID.
bool first_active(const DevList& dl, RailSpec& out) {
  for (int d = 0; d < dl.n; ++d) {
    Ctx ctx(dl.list[d]);
    if (!ctx.c) continue;
    ibv_device_attr da{};
    if (ibv_query_device(ctx.c, &da) != 0) continue;
    for (int p = 1; p <= da.phys_port_cnt; ++p) {
      ibv_port_attr pa{};
      if (ibv_query_port(ctx.c, static_cast<uint8_t>(p), &pa) != 0) continue;
      if (pa.state != IBV_PORT_ACTIVE) continue;
      const int gi = auto_gid_index(ctx.c, p, pa);
      if (gi < 0) continue;
      out.dev = ibv_get_device_name(dl.list[d]);
      out.port = p;
      out.gid_index = gi;
      return true;
    }
  }
  return false;
}

[[noreturn]] void no_device() {
  fail(ErrorKind::Unsupported,
       "ibverbs transport unavailable: no RDMA device (ibv_get_device_list found none)");
}

RailSpec resolve_spec(const DevList& dl, const std::string& spec, int rail) {
  RailSpec rs;
  const std::string what = "ibverbs rail " + std::to_string(rail) + " ('" + spec + "')";
  in_addr a{};
  if (inet_pton(AF_INET, spec.c_str(), &a) == 1) {
    if (!find_by_ipv4(dl, spec, rs))
      fail(ErrorKind::InvalidInput, what, ": no RDMA device has a GID for IPv4 address ", spec,
           " (devices: ", known_devices(dl), "); give the rail as 'DEVICE:PORT' instead");
    return rs;
  }
  const auto c1 = spec.find(':');
  if (c1 == std::string::npos || c1 == 0)
    fail(ErrorKind::InvalidInput, what,
         ": expected an IPv4 address, 'DEVICE:PORT' or 'DEVICE:PORT:GID_INDEX'");
  rs.dev = spec.substr(0, c1);
  const auto c2 = spec.find(':', c1 + 1);
  const std::string port_s = spec.substr(c1 + 1, c2 == std::string::npos ? std::string::npos : c2 - c1 - 1);
  char* end = nullptr;
  const long port = std::strtol(port_s.c_str(), &end, 10);
  if (port_s.empty() || !end || *end || port < 1 || port > 255)
    fail(ErrorKind::InvalidInput, what, ": bad port number '", port_s, "'");
  rs.port = static_cast<int>(port);
  long gidx = -1;
  if (c2 != std::string::npos) {
    const std::string g = spec.substr(c2 + 1);
    gidx = std::strtol(g.c_str(), &end, 10);
    if (g.empty() || !end || *end || gidx < 0)
      fail(ErrorKind::InvalidInput, what, ": bad GID index '", g, "'");
  }
  int d = 0;
  for (; d < dl.n; ++d)
    if (rs.dev == ibv_get_device_name(dl.list[d])) break;
  if (d == dl.n)
    fail(ErrorKind::InvalidInput, what, ": no RDMA device named '", rs.dev, "' (devices: ",
         known_devices(dl), ")");
  Ctx ctx(dl.list[d]);
  if (!ctx.c) fail(ErrorKind::Runtime, what, ": ibv_open_device failed: ", errstr(errno));
  ibv_device_attr da{};
  if (ibv_query_device(ctx.c, &da) != 0)
    fail(ErrorKind::Runtime, what, ": ibv_query_device failed: ", errstr(errno));
  if (rs.port > da.phys_port_cnt)
    fail(ErrorKind::InvalidInput, what, ": device ", rs.dev, " has ", int(da.phys_port_cnt),
         " port(s)");
  ibv_port_attr pa{};
  if (ibv_query_port(ctx.c, static_cast<uint8_t>(rs.port), &pa) != 0)
    fail(ErrorKind::Runtime, what, ": ibv_query_port failed: ", errstr(errno));
  if (gidx >= 0) {
    if (gidx >= pa.gid_tbl_len)
      fail(ErrorKind::InvalidInput, what, ": GID index ", gidx, " out of range (table has ",
           pa.gid_tbl_len, ")");
    rs.gid_index = static_cast<int>(gidx);
  } else {
    rs.gid_index = auto_gid_index(ctx.c, rs.port, pa);
    if (rs.gid_index < 0)
      fail(ErrorKind::InvalidInput, what, ": port has no valid GID (is the netdev up?)");
  }
  return rs;
}

std::vector<RailSpec> resolve_rails(const GroupOptions& opts, int n_rails,
                                    const std::string& boot_ip) {
  DevList dl;
  if (dl.n == 0) no_device();
  std::vector<RailSpec> out;
  if (opts.rails.empty()) {
    RailSpec rs;
    if (!boot_ip.empty() && find_by_ipv4(dl, boot_ip, rs)) {
    } else if (!first_active(dl, rs)) {
      fail(ErrorKind::Unsupported, "ibverbs transport: no active RDMA port with a usable GID "
           "(devices: ", known_devices(dl), ")");
    }
    out.push_back(rs);
    return out;
  }
  for (int i = 0; i < n_rails && i < static_cast<int>(opts.rails.size()); ++i)
    out.push_back(resolve_spec(dl, opts.rails[size_t(i)], i));
  return out;
}

// ---- one rail ------------------------------------------------------------------------------
struct LocalInfo {
  uint32_t qpn = 0, psn = 0, rkey = 0;
  uint16_t lid = 0;
  ibv_gid gid{};
  uint64_t addr = 0, ring = 0;
  int mtu = 0;  // ibv_mtu enum value
  std::string label;
};

struct IbRail {
  RailSpec spec;
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_cq* cq = nullptr;
  ibv_qp* qp = nullptr;
  ibv_mr* send_mr = nullptr;
  ibv_mr* recv_mr = nullptr;
  ibv_mr* ctrl_mr = nullptr;
  uint8_t* send_buf = nullptr;
  uint8_t* recv_buf = nullptr;
  CtrlMsg* ctrl = nullptr;  // kRecvSlots receive slots, then kCtrlSlots send slots
  size_t buf_bytes = 0;     // allocated ring bytes
  size_t ring = 0;          // agreed ring bytes
  uint32_t max_inline = 0;
  bool ethernet = false;
  ibv_port_attr pattr{};
  LocalInfo me;
  // remote
  uint64_t remote_addr = 0;
  uint32_t remote_rkey = 0;
  // sending
  uint64_t tx_head = 0, tx_done = 0, peer_consumed = 0;
  int sq_out = 0, ctrl_out = 0;
  uint64_t ctrl_seq = 0;
  bool notify_done = false;
  // receiving
  uint64_t rx_tail = 0, rx_head = 0, credit_sent = 0;
  bool peer_eof = false;
  std::string eof_reason;
  // state
  bool up = true;
  std::string reason, local, peer;

  ~IbRail() {
    if (qp) ibv_destroy_qp(qp);
    if (cq) ibv_destroy_cq(cq);
    if (send_mr) ibv_dereg_mr(send_mr);
    if (recv_mr) ibv_dereg_mr(recv_mr);
    if (ctrl_mr) ibv_dereg_mr(ctrl_mr);
    if (pd) ibv_dealloc_pd(pd);
    if (ctx) ibv_close_device(ctx);
    std::free(send_buf);
    std::free(recv_buf);
    std::free(ctrl);
  }
};

void* alloc_aligned(size_t n) {
  void* p = nullptr;
  if (posix_memalign(&p, 4096, n) != 0 || !p) fail(ErrorKind::OutOfMemory, "ibverbs: cannot allocate ", n, " bytes");
  std::memset(p, 0, n);
  return p;
}

void post_recv_slot(IbRail& r, uint64_t slot) {
  ibv_sge sge{reinterpret_cast<uint64_t>(&r.ctrl[slot]), sizeof(CtrlMsg), r.ctrl_mr->lkey};
  ibv_recv_wr wr{};
  wr.wr_id = (kTypeRecv << kTypeShift) | slot;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  const int rc = ibv_post_recv(r.qp, &wr, &bad);
  if (rc != 0 && r.up) {
    r.up = false;
    r.reason = "ibv_post_recv: " + errstr(rc);
  }
}

// Opens the device, allocates and registers the rings, creates the QP (RESET -> INIT) and
// posts the receives.
void open_rail(IbRail& r, const DevList& dl, size_t ring) {
  const std::string what = "ibverbs rail " + r.spec.label();
  for (int d = 0; d < dl.n; ++d)
    if (r.spec.dev == ibv_get_device_name(dl.list[d])) r.ctx = ibv_open_device(dl.list[d]);
  if (!r.ctx) fail(ErrorKind::Runtime, what, ": ibv_open_device failed: ", errstr(errno));
  if (ibv_query_port(r.ctx, static_cast<uint8_t>(r.spec.port), &r.pattr) != 0)
    fail(ErrorKind::Runtime, what, ": ibv_query_port failed: ", errstr(errno));
  if (r.pattr.state != IBV_PORT_ACTIVE)
    fail(ErrorKind::Runtime, what, ": port is ", port_state_str(r.pattr.state), ", not ACTIVE");
  r.ethernet = r.pattr.link_layer == IBV_LINK_LAYER_ETHERNET;
  r.pd = ibv_alloc_pd(r.ctx);
  if (!r.pd) fail(ErrorKind::Runtime, what, ": ibv_alloc_pd failed: ", errstr(errno));
  r.buf_bytes = ring;
  r.send_buf = static_cast<uint8_t*>(alloc_aligned(ring));
  r.recv_buf = static_cast<uint8_t*>(alloc_aligned(ring));
  r.ctrl = static_cast<CtrlMsg*>(alloc_aligned(sizeof(CtrlMsg) * (kRecvSlots + kCtrlSlots)));
  r.send_mr = ibv_reg_mr(r.pd, r.send_buf, ring, IBV_ACCESS_LOCAL_WRITE);
  r.recv_mr = ibv_reg_mr(r.pd, r.recv_buf, ring, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  r.ctrl_mr = ibv_reg_mr(r.pd, r.ctrl, sizeof(CtrlMsg) * (kRecvSlots + kCtrlSlots),
                         IBV_ACCESS_LOCAL_WRITE);
  if (!r.send_mr || !r.recv_mr || !r.ctrl_mr)
    fail(ErrorKind::Runtime, what, ": ibv_reg_mr failed: ", errstr(errno),
         " (check the locked-memory limit, ulimit -l)");
  r.cq = ibv_create_cq(r.ctx, kMaxSendWr + kRecvSlots + 16, nullptr, nullptr, 0);
  if (!r.cq) fail(ErrorKind::Runtime, what, ": ibv_create_cq failed: ", errstr(errno));
  for (uint32_t inl : {256u, 128u, 64u, 0u}) {
    ibv_qp_init_attr ia{};
    ia.send_cq = r.cq;
    ia.recv_cq = r.cq;
    ia.qp_type = IBV_QPT_RC;
    ia.sq_sig_all = 0;
    ia.cap.max_send_wr = kMaxSendWr;
    ia.cap.max_recv_wr = kRecvSlots;
    ia.cap.max_send_sge = 1;
    ia.cap.max_recv_sge = 1;
    ia.cap.max_inline_data = inl;
    r.qp = ibv_create_qp(r.pd, &ia);
    if (r.qp) {
      r.max_inline = ia.cap.max_inline_data;
      break;
    }
  }
  if (!r.qp) fail(ErrorKind::Runtime, what, ": ibv_create_qp(RC) failed: ", errstr(errno));

  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = static_cast<uint8_t>(r.spec.port);
  a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE;
  int rc = ibv_modify_qp(r.qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
  if (rc) fail(ErrorKind::Runtime, what, ": QP -> INIT failed: ", errstr(rc));
  for (uint64_t s = 0; s < kRecvSlots; ++s) post_recv_slot(r, s);
  if (!r.up) fail(ErrorKind::Runtime, what, ": ", r.reason);

  std::random_device rd;
  r.me.qpn = r.qp->qp_num;
  r.me.psn = rd() & 0xffffff;
  r.me.rkey = r.recv_mr->rkey;
  r.me.lid = r.pattr.lid;
  if (ibv_query_gid(r.ctx, static_cast<uint8_t>(r.spec.port), r.spec.gid_index, &r.me.gid) != 0)
    fail(ErrorKind::Runtime, what, ": ibv_query_gid failed: ", errstr(errno));
  r.me.addr = reinterpret_cast<uint64_t>(r.recv_buf);
  r.me.ring = ring;
  r.me.mtu = static_cast<int>(r.pattr.active_mtu);
  r.me.label = r.spec.label();
}

std::string info_line(const LocalInfo& m) {
  std::ostringstream os;
  os << m.qpn << ' ' << m.psn << ' ' << m.rkey << ' ' << m.lid << ' ' << gid_hex(m.gid) << ' '
     << m.addr << ' ' << m.ring << ' ' << m.mtu << ' ' << m.label;
  return os.str();
}

bool parse_info(std::istream& is, LocalInfo& m) {
  std::string gid;
  if (!(is >> m.qpn >> m.psn >> m.rkey >> m.lid >> gid >> m.addr >> m.ring >> m.mtu >> m.label))
    return false;
  return parse_gid(gid, m.gid) && m.ring >= 4096;
}

void connect_rail(IbRail& r, const LocalInfo& peer, size_t ring) {
  const std::string what = "ibverbs rail " + r.spec.label();
  r.ring = ring;
  r.remote_addr = peer.addr;
  r.remote_rkey = peer.rkey;
  r.local = r.me.label + " qp " + std::to_string(r.me.qpn);
  r.peer = peer.label + " qp " + std::to_string(peer.qpn) +
           (r.ethernet ? " gid " + (gid_ipv4(peer.gid).empty() ? gid_hex(peer.gid) : gid_ipv4(peer.gid))
                       : " lid " + std::to_string(peer.lid));

  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = static_cast<ibv_mtu>(std::min(r.me.mtu, peer.mtu));
  a.dest_qp_num = peer.qpn;
  a.rq_psn = peer.psn;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = 12;
  a.ah_attr.port_num = static_cast<uint8_t>(r.spec.port);
  a.ah_attr.sl = 0;
  a.ah_attr.src_path_bits = 0;
  a.ah_attr.dlid = peer.lid;
  if (r.ethernet || (!gid_is_zero(peer.gid) && peer.lid == 0)) {
    a.ah_attr.is_global = 1;
    a.ah_attr.grh.dgid = peer.gid;
    a.ah_attr.grh.sgid_index = static_cast<uint8_t>(r.spec.gid_index);
    a.ah_attr.grh.hop_limit = 64;
    a.ah_attr.grh.flow_label = 0;
    a.ah_attr.grh.traffic_class = 0;
  }
  int rc = ibv_modify_qp(r.qp, &a,
                         IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                             IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
  if (rc) fail(ErrorKind::Runtime, what, ": QP -> RTR failed: ", errstr(rc));

  ibv_qp_attr s{};
  s.qp_state = IBV_QPS_RTS;
  s.timeout = static_cast<uint8_t>(timeout_env());
  s.retry_cnt = 7;
  s.rnr_retry = 7;  // infinite: a receiver that is slow to repost is not a failure
  s.sq_psn = r.me.psn;
  s.max_rd_atomic = 1;
  rc = ibv_modify_qp(r.qp, &s,
                     IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                         IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
  if (rc) fail(ErrorKind::Runtime, what, ": QP -> RTS failed: ", errstr(rc));
}

// ---- transport -----------------------------------------------------------------------------
class IbvTransport final : public Transport {
 public:
  explicit IbvTransport(std::vector<std::unique_ptr<IbRail>> rails) : rails_(std::move(rails)) {}

  // Let queued writes (the group's goodbye) complete, tell the peer we are closing, then
  // tear the verbs objects down (IbRail's destructor).
  ~IbvTransport() override {
    const Deadline dl = Clock::now() + std::chrono::milliseconds(500);
    for (;;) {
      bool busy = false;
      for (int i = 0; i < num_rails(); ++i) {
        IbRail& r = *rails_[size_t(i)];
        if (!r.up) continue;
        poll(i);
        if (r.up && r.sq_out > 0) busy = true;
      }
      if (!busy || Clock::now() >= dl) break;
      std::this_thread::yield();
    }
    for (int i = 0; i < num_rails(); ++i) {
      IbRail& r = *rails_[size_t(i)];
      if (!r.up) continue;
      notify_and_wait(i, kCtrlClose);
      to_error(r);
    }
  }

  const char* name() const override { return "ibverbs"; }
  int num_rails() const override { return static_cast<int>(rails_.size()); }
  bool up(int r) const override { return rails_[size_t(r)]->up; }
  std::string down_reason(int r) const override { return rails_[size_t(r)]->reason; }
  std::string local_addr(int r) const override { return rails_[size_t(r)]->local; }
  std::string peer_addr(int r) const override { return rails_[size_t(r)]->peer; }

  long send_some(int ri, const void* head, size_t hn, const void* body, size_t bn) override {
    IbRail& r = *rails_[size_t(ri)];
    if (!r.up) return -1;
    poll(ri);
    if (!r.up) return -1;
    if (r.peer_eof) {
      // Nothing sent now can be delivered; report the close once the input is drained.
      if (r.rx_head == r.rx_tail) {
        mark_down(r, r.eof_reason);
        return -1;
      }
      return 0;
    }
    const size_t total = hn + bn;
    if (total == 0) return 0;
    if (r.sq_out - r.ctrl_out >= kMaxSendWr - kCtrlSlots) return 0;
    const size_t n = tx_space(r, total);
    if (n == 0) return 0;
    const size_t pos = static_cast<size_t>(r.tx_head % r.ring);
    uint8_t* p = r.send_buf + pos;
    const size_t h = std::min(n, hn);
    if (h) std::memcpy(p, head, h);
    if (n > h) std::memcpy(p + h, body, n - h);

    ibv_sge sge{reinterpret_cast<uint64_t>(p), static_cast<uint32_t>(n), r.send_mr->lkey};
    ibv_send_wr wr{};
    wr.wr_id = (kTypeData << kTypeShift) | ((r.tx_head + n) & kLowMask);
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    wr.send_flags = IBV_SEND_SIGNALED | (n <= r.max_inline ? IBV_SEND_INLINE : 0);
    wr.imm_data = htonl(static_cast<uint32_t>(n));
    wr.wr.rdma.remote_addr = r.remote_addr + pos;
    wr.wr.rdma.rkey = r.remote_rkey;
    ibv_send_wr* bad = nullptr;
    const int rc = ibv_post_send(r.qp, &wr, &bad);
    if (rc != 0) {
      mark_down(r, "ibv_post_send (RDMA write): " + errstr(rc));
      return -1;
    }
    r.tx_head += n;
    ++r.sq_out;
    return static_cast<long>(n);
  }

  long recv_some(int ri, void* dst, size_t len) override {
    IbRail& r = *rails_[size_t(ri)];
    if (!r.up) return -1;
    if (r.rx_tail == r.rx_head) {
      poll(ri);
      if (!r.up) return -1;
    }
    if (len == 0) return 0;
    const uint64_t avail = r.rx_tail - r.rx_head;
    if (avail == 0) {
      if (r.peer_eof) {
        mark_down(r, r.eof_reason);
        return -1;
      }
      return 0;
    }
    const size_t pos = static_cast<size_t>(r.rx_head % r.ring);
    const size_t n = std::min<size_t>({len, static_cast<size_t>(avail), r.ring - pos});
    std::memcpy(dst, r.recv_buf + pos, n);
    r.rx_head += n;
    maybe_credit(r);
    return static_cast<long>(n);
  }

  bool wait(const std::vector<uint8_t>& want_rx, const std::vector<uint8_t>& want_tx,
            int timeout_ms, std::vector<uint8_t>& ready_rx,
            std::vector<uint8_t>& ready_tx) override {
    const int n = num_rails();
    ready_rx.assign(size_t(n), 0);
    ready_tx.assign(size_t(n), 0);
    std::vector<uint8_t> watch(size_t(n), 0);
    bool any_watch = false;
    for (int i = 0; i < n; ++i) {
      watch[size_t(i)] = rails_[size_t(i)]->up && (want_rx[size_t(i)] || want_tx[size_t(i)]);
      any_watch |= watch[size_t(i)] != 0;
    }
    if (!any_watch) {
      if (timeout_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(timeout_ms));
      return false;
    }
    const Deadline dl = Clock::now() + std::chrono::milliseconds(std::max(0, timeout_ms));
    for (unsigned spin = 0;; ++spin) {
      bool any = false;
      for (int i = 0; i < n; ++i) {
        if (!watch[size_t(i)]) continue;
        IbRail& r = *rails_[size_t(i)];
        poll(i);
        if (!r.up) {  // failures are readiness: the caller's next I/O reports them
          ready_rx[size_t(i)] = want_rx[size_t(i)];
          ready_tx[size_t(i)] = want_tx[size_t(i)];
          any = true;
          continue;
        }
        if (want_rx[size_t(i)] && (r.rx_tail != r.rx_head || r.peer_eof)) {
          ready_rx[size_t(i)] = 1;
          any = true;
        }
        // After the peer's close notice, tx is "ready" once the input is drained so that
        // the next send_some reports the rail down.
        const bool tx_ok = r.peer_eof ? r.rx_tail == r.rx_head
                                      : tx_space(r, 1) > 0 &&
                                            r.sq_out - r.ctrl_out < kMaxSendWr - kCtrlSlots;
        if (want_tx[size_t(i)] && tx_ok) {
          ready_tx[size_t(i)] = 1;
          any = true;
        }
      }
      if (any) return true;
      if (Clock::now() >= dl) return false;
      if (spin > 64) std::this_thread::yield();
    }
  }

  void fail_rail(int ri, const std::string& why) override {
    IbRail& r = *rails_[size_t(ri)];
    if (!r.up) return;
    r.up = false;
    r.reason = why;
    notify_and_wait(ri, kCtrlDown);
    to_error(r);
  }

 private:
  // Bytes (<= want) that may be written now without overrunning the peer's ring or reusing
  // staging bytes whose write has not completed; never wraps.
  static size_t tx_space(const IbRail& r, size_t want) {
    const uint64_t oldest = std::min(r.peer_consumed, r.tx_done);
    const uint64_t used = r.tx_head - oldest;
    if (used >= r.ring) return 0;
    const size_t pos = static_cast<size_t>(r.tx_head % r.ring);
    return std::min<size_t>({want, static_cast<size_t>(r.ring - used), r.ring - pos, r.ring / 4});
  }

  static void to_error(IbRail& r) {
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_ERR;
    ibv_modify_qp(r.qp, &a, IBV_QP_STATE);
  }

  static void mark_down(IbRail& r, const std::string& why) {
    if (!r.up) return;
    r.up = false;
    r.reason = why;
    to_error(r);
  }

  // Posts a control SEND; false when no slot is free or posting failed.
  static bool post_ctrl(IbRail& r, uint64_t kind, uint64_t value, bool notify) {
    if (r.ctrl_out >= kCtrlSlots || r.sq_out >= kMaxSendWr) return false;
    const uint64_t slot = kRecvSlots + (r.ctrl_seq++ % kCtrlSlots);
    r.ctrl[slot] = CtrlMsg{kind, value};
    ibv_sge sge{reinterpret_cast<uint64_t>(&r.ctrl[slot]), sizeof(CtrlMsg), r.ctrl_mr->lkey};
    ibv_send_wr wr{};
    wr.wr_id = (kTypeCtrl << kTypeShift) | (notify ? kNotifyBit : 0) | slot;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = IBV_SEND_SIGNALED | (sizeof(CtrlMsg) <= r.max_inline ? IBV_SEND_INLINE : 0);
    ibv_send_wr* bad = nullptr;
    if (ibv_post_send(r.qp, &wr, &bad) != 0) return false;
    ++r.ctrl_out;
    ++r.sq_out;
    return true;
  }

  // Return credit once a quarter of the ring has been consumed since the last report.
  static void maybe_credit(IbRail& r) {
    if (!r.up || r.peer_eof) return;
    if (r.rx_head - r.credit_sent < r.ring / 4) return;
    if (post_ctrl(r, kCtrlCredit, r.rx_head, false)) r.credit_sent = r.rx_head;
  }

  // Best effort: tell the peer this rail is going away and give the SEND a moment to land.
  void notify_and_wait(int ri, uint64_t kind) {
    IbRail& r = *rails_[size_t(ri)];
    if (r.peer_eof) return;
    r.notify_done = false;
    if (!post_ctrl(r, kind, 0, true)) return;
    const Deadline dl = Clock::now() + std::chrono::milliseconds(100);
    while (!r.notify_done && Clock::now() < dl) {
      drain_cq(r);
      std::this_thread::yield();
    }
  }

  void poll(int ri) {
    IbRail& r = *rails_[size_t(ri)];
    drain_cq(r);
    maybe_credit(r);
  }

  // Handles every completion queued on the rail's CQ.
  static void drain_cq(IbRail& r) {
    ibv_wc wc[32];
    for (;;) {
      const int n = ibv_poll_cq(r.cq, 32, wc);
      if (n < 0) {
        mark_down(r, "ibv_poll_cq failed");
        return;
      }
      for (int i = 0; i < n; ++i) on_completion(r, wc[i]);
      if (n < 32) return;
    }
  }

  static void on_completion(IbRail& r, const ibv_wc& wc) {
    const uint64_t type = wc.wr_id >> kTypeShift;
    const uint64_t low = wc.wr_id & kLowMask;
    if (type == kTypeData || type == kTypeCtrl) {
      --r.sq_out;
      if (type == kTypeCtrl) {
        --r.ctrl_out;
        if (low & kNotifyBit) r.notify_done = true;
      }
    }
    if (wc.status != IBV_WC_SUCCESS) {
      const char* op = type == kTypeData ? "RDMA write" : type == kTypeCtrl ? "control send" : "receive";
      std::ostringstream os;
      if (wc.status == IBV_WC_WR_FLUSH_ERR)
        os << "ibverbs " << op << " flushed (queue pair in error state)";
      else
        os << "ibverbs " << op << " failed: " << ibv_wc_status_str(wc.status) << " (status "
           << int(wc.status) << ", vendor_err 0x" << std::hex << wc.vendor_err << ")";
      mark_down(r, os.str());
      return;
    }
    if (type == kTypeData) {
      r.tx_done = std::max(r.tx_done, low);
      return;
    }
    if (type != kTypeRecv) return;
    if (!r.up) return;
    if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
      const uint32_t bytes = ntohl(wc.imm_data);
      r.rx_tail += bytes;
      if (r.rx_tail - r.rx_head > r.ring) {
        mark_down(r, "ibverbs protocol error: peer overran the receive ring");
        return;
      }
    } else if (wc.opcode == IBV_WC_RECV) {
      const CtrlMsg m = r.ctrl[low];
      if (m.kind == kCtrlCredit) {
        r.peer_consumed = std::max(r.peer_consumed, std::min(m.value, r.tx_head));
      } else if (m.kind == kCtrlDown || m.kind == kCtrlClose) {
        r.peer_eof = true;
        r.eof_reason = m.kind == kCtrlDown ? "peer took the rail down" : "connection closed by peer";
      } else {
        mark_down(r, "ibverbs protocol error: unknown control message");
        return;
      }
    }
    post_recv_slot(r, low);
  }

  std::vector<std::unique_ptr<IbRail>> rails_;
};

}  // namespace

bool built_with_ibverbs() { return true; }

std::vector<IbvDeviceInfo> ibverbs_devices() {
  std::vector<IbvDeviceInfo> out;
  DevList dl;
  for (int d = 0; d < dl.n; ++d) {
    IbvDeviceInfo di;
    di.name = ibv_get_device_name(dl.list[d]);
    Ctx ctx(dl.list[d]);
    if (ctx.c) {
      ibv_device_attr da{};
      if (ibv_query_device(ctx.c, &da) == 0) {
        for (int p = 1; p <= da.phys_port_cnt; ++p) {
          ibv_port_attr pa{};
          if (ibv_query_port(ctx.c, static_cast<uint8_t>(p), &pa) != 0) continue;
          IbvPortInfo pi;
          pi.port = p;
          pi.state = port_state_str(pa.state);
          pi.link_layer = pa.link_layer == IBV_LINK_LAYER_ETHERNET ? "Ethernet" : "InfiniBand";
          pi.active_mtu = mtu_bytes(pa.active_mtu);
          pi.lid = pa.lid;
          for (const auto& g : port_gids(ctx.c, p, pa.gid_tbl_len))
            pi.gids.push_back({g.index, gid_hex(g.gid), gid_type_str(g.type), gid_ipv4(g.gid)});
          di.ports.push_back(std::move(pi));
        }
      }
    }
    out.push_back(std::move(di));
  }
  return out;
}

void ibverbs_preflight(const GroupOptions& opts) {
  DevList dl;
  if (dl.n == 0) no_device();
  if (!opts.rails.empty()) {
    // Validates every spec (device names, ports, GIDs for addresses).
    resolve_rails(opts, static_cast<int>(opts.rails.size()), "");
  }
}

std::unique_ptr<Transport> ibverbs_transport(const GroupOptions& opts, int n_rails,
                                             Bootstrap& boot, Deadline dl) {
  const size_t my_ring = ring_bytes_env();
  std::vector<std::unique_ptr<IbRail>> rails;
  std::string mine;
  try {
    const auto specs = resolve_rails(opts, n_rails, boot.local_ip());
    DevList devs;
    std::ostringstream os;
    os << "ibv1 " << specs.size();
    for (const auto& s : specs) {
      rails.push_back(std::make_unique<IbRail>());
      rails.back()->spec = s;
      open_rail(*rails.back(), devs, my_ring);
      os << '\n' << info_line(rails.back()->me);
    }
    mine = os.str();
  } catch (const Error& e) {
    try {
      boot.send_msg(std::string("ibv-error ") + e.what(), dl);
    } catch (...) {
    }
    throw;
  }
  boot.send_msg(mine, dl);
  const std::string theirs = boot.recv_msg(dl);
  if (theirs.rfind("ibv-error ", 0) == 0)
    fail(ErrorKind::Runtime, "ibverbs setup failed on the peer (", boot.peer_addr(), "): ",
         theirs.substr(10));
  std::istringstream is(theirs);
  std::string tag;
  size_t peer_n = 0;
  if (!(is >> tag >> peer_n) || tag != "ibv1")
    fail(ErrorKind::Runtime, "ibverbs setup: unexpected message from the peer");
  if (peer_n != rails.size())
    fail(ErrorKind::Runtime, "ibverbs setup: peer opened ", peer_n, " rail(s), this rank ",
         rails.size());
  std::vector<LocalInfo> peer(rails.size());
  for (auto& p : peer)
    if (!parse_info(is, p)) fail(ErrorKind::Runtime, "ibverbs setup: malformed rail info from the peer");
  for (size_t i = 0; i < rails.size(); ++i) {
    const size_t ring = std::min<size_t>(my_ring, static_cast<size_t>(peer[i].ring));
    connect_rail(*rails[i], peer[i], ring);
  }
  // Both sides are RTR/RTS before anyone writes.
  boot.send_msg("ibv-ready", dl);
  const std::string ok = boot.recv_msg(dl);
  if (ok != "ibv-ready") fail(ErrorKind::Runtime, "ibverbs setup: peer did not confirm the rails: ", ok);
  return std::make_unique<IbvTransport>(std::move(rails));
}

}  // namespace tf::comm
