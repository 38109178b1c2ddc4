// Group factory and the shared two-rank collective algorithm. Transports (transport.h) only
// move bytes on rails; everything about messages, chunking, striping, acknowledgement and
// rail fail-over lives here.
//
// Wire protocol (per rail, a stream of messages): a 40-byte Header, then `len` payload bytes.
//   DATA {seq, total, offset, len}: bytes [offset, offset+len) of the sender's message for
//        collective number `seq` (both ranks number collectives identically).
//   DONE {seq}: "I have received all your data for every collective <= seq" (cumulative).
//   BYE: the peer closed the group on purpose (sent on every rail before closing).
// Every collective is an exchange: each rank sends its message (possibly none) and receives
// the peer's (possibly none). A rank's message is either
//   * small (<= small_bytes): one DATA on one rail, no chunking. The sender keeps a copy
//     ("retained") until the peer acknowledges it, so it never waits for an ack; or
//   * large: chunks of chunk_bytes striped over the live rails by measured throughput; the
//     sender completes only after the peer's DONE for that collective, so its buffer can be
//     re-sent from if a rail dies mid-way.
// Acknowledgements: explicit DONE after receiving a large message (or when this rank sends
// nothing back); implicitly, any message from the peer for collective s acknowledges s-1,
// because the peer only starts s after receiving all of our data for s-1.
// Receiving: chunks are placed by offset and counted once (duplicates discarded). Messages
// for a later collective (the peer may be one ahead) are stashed and applied when this rank
// gets there; messages for earlier ones are discarded.
// Rail loss: the rail's partial input is dropped; every chunk this rank put on that rail in
// the current collective goes back to the pool for the remaining rails, unacknowledged small
// messages sent on it are re-sent, and the latest DONE is repeated. All rails down = peer lost.
#include "comm/group.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <system_error>
#include <thread>

#include "comm/ibverbs_transport.h"
#include "comm/transport.h"
#include "core/error.h"
#include "core/half.h"
#include "core/interrupt.h"
#include "core/sha256.h"

namespace tf::comm {
namespace {

constexpr uint32_t kMsgMagic = 0x54464331;  // "TFC1"
constexpr const char* kProtocol = "tensorfold-comm 2";  // 2: nonces and token proofs
constexpr uint32_t kData = 1, kDone = 2, kBye = 3;
enum OpKind : uint32_t { kAllReduce = 1, kBroadcast = 2, kBarrier = 3 };

struct Header {
  uint32_t magic;
  uint32_t type;  // kData | kind << 8, or kDone
  uint64_t seq;
  uint64_t total;
  uint64_t offset;
  uint64_t len;
};
static_assert(sizeof(Header) == 40, "wire header must be 40 bytes");

const char* kind_name(uint32_t k) {
  switch (k) {
    case kAllReduce: return "all_reduce";
    case kBroadcast: return "broadcast";
    case kBarrier: return "barrier";
    default: return "unknown";
  }
}

size_t dtype_size(DType d) { return d == DType::F32 ? 4 : 2; }

using Bytes = std::shared_ptr<std::vector<uint8_t>>;

// TF_COMM_TRACE=1: protocol events on stderr (debugging aid).
const bool kTrace = [] {
  const char* e = std::getenv("TF_COMM_TRACE");
  return e && *e && *e != '0';
}();
#define TF_COMM_TRACE(...)                    \
  do {                                        \
    if (kTrace) {                             \
      std::fprintf(stderr, "[comm r%d] ", rank_); \
      std::fprintf(stderr, __VA_ARGS__);      \
      std::fprintf(stderr, "\n");             \
    }                                         \
  } while (0)

struct TxItem {
  Header h{};
  const uint8_t* body = nullptr;  // user memory (large chunk) or keep->data()
  Bytes keep;
  size_t sent = 0;  // bytes of header + body written so far
  bool user_mem = false;
  uint32_t chunk = 0;
  size_t size() const { return sizeof(Header) + h.len; }
};

enum class Sink { Dst, Discard, Stash };

struct RailState {
  std::deque<TxItem> txq;
  // receive state machine
  Header rh{};
  size_t rh_got = 0;
  bool in_body = false;
  Sink sink = Sink::Discard;
  uint8_t* sink_ptr = nullptr;
  Bytes stash_buf;
  size_t body_got = 0;
  // striping for the current large collective
  std::deque<uint32_t> pending;   // chunks assigned, not yet queued
  std::vector<uint32_t> assigned; // chunks queued on this rail during this collective
  // accounting
  bool handled_down = false;
  uint64_t bytes_sent = 0, bytes_received = 0;
  uint64_t op_bytes = 0;
  Clock::time_point op_first{}, op_last{}, last_tx_progress{};
  double ewma_mb_s = 0;
};

struct Retained {
  uint64_t seq;
  Header h;
  Bytes data;
  int rail;
};

struct Stashed {
  Header h;
  Bytes data;
};

// Current collective.
struct Op {
  uint64_t seq = 0;
  uint32_t kind = 0;
  bool has_send = false, large = false;
  const uint8_t* src = nullptr;
  size_t send_bytes = 0;
  bool has_recv = false;
  uint8_t* dst = nullptr;
  size_t recv_bytes = 0;
  size_t recv_chunk = 0;
  uint32_t recv_chunks = 0, recv_got = 0;
  std::vector<uint8_t> got;
  bool recv_announced = false;
  // broadcast_idle: Ctrl-C is honoured until the first byte arrives (see group.h).
  bool idle = false, rx_started = false;
};

void reduce_into(uint8_t* mine, const uint8_t* peer, size_t n, DType dt, int rank) {
  // Sum in rank order (rank 0's value + rank 1's value) so both ranks get identical bits.
  const uint8_t* a = rank == 0 ? mine : peer;
  const uint8_t* b = rank == 0 ? peer : mine;
  switch (dt) {
    case DType::F32: {
      float* out = reinterpret_cast<float*>(mine);
      const float* x = reinterpret_cast<const float*>(a);
      const float* y = reinterpret_cast<const float*>(b);
      for (size_t i = 0; i < n; ++i) out[i] = x[i] + y[i];
      break;
    }
    case DType::F16: {
      uint16_t* out = reinterpret_cast<uint16_t*>(mine);
      const uint16_t* x = reinterpret_cast<const uint16_t*>(a);
      const uint16_t* y = reinterpret_cast<const uint16_t*>(b);
      for (size_t i = 0; i < n; ++i) out[i] = fp32_to_fp16(fp16_to_fp32(x[i]) + fp16_to_fp32(y[i]));
      break;
    }
    case DType::BF16: {
      uint16_t* out = reinterpret_cast<uint16_t*>(mine);
      const uint16_t* x = reinterpret_cast<const uint16_t*>(a);
      const uint16_t* y = reinterpret_cast<const uint16_t*>(b);
      for (size_t i = 0; i < n; ++i) out[i] = fp32_to_bf16(bf16_to_fp32(x[i]) + bf16_to_fp32(y[i]));
      break;
    }
  }
}

// ---------------------------------------------------------------------------------------
class SoloGroup final : public Group {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void all_reduce(void*, size_t, DType) override { ++stats_.all_reduces; }
  void broadcast(void*, size_t, int root) override {
    TF_CHECK(root == 0, "broadcast root ", root, " out of range for a group of size 1");
    ++stats_.broadcasts;
  }
  void barrier() override { ++stats_.barriers; }
  GroupStats stats() const override { return stats_; }
  void broadcast_idle(void* data, size_t bytes, int root) override { broadcast(data, bytes, root); }

 private:
  GroupStats stats_;
};

// ---------------------------------------------------------------------------------------
class PairGroup final : public Group {
 public:
  PairGroup(const GroupOptions& opts, std::unique_ptr<Transport> tr, size_t small_bytes,
            size_t chunk_bytes)
      : rank_(opts.rank),
        timeout_s_(opts.timeout_s),
        small_(small_bytes),
        chunk_(chunk_bytes),
        tr_(std::move(tr)),
        rails_(static_cast<size_t>(tr_->num_rails())),
        fail_after_(new std::atomic<int64_t>[static_cast<size_t>(tr_->num_rails())]) {
    for (int r = 0; r < nr(); ++r) fail_after_[r].store(-1);
    publish_stats();
  }

  // Say goodbye on every live rail (so the peer reports "peer closed the group" rather than a
  // rail failure), best effort and briefly bounded; the transport then closes gracefully.
  ~PairGroup() override {
    if (!broken_.empty()) return;
    try {
      for (int r = 0; r < nr(); ++r) {
        if (!tr_->up(r) || !rails_[size_t(r)].txq.empty()) continue;
        TxItem it;
        it.h = {kMsgMagic, kBye, seq_, 0, 0, 0};
        rails_[size_t(r)].txq.push_back(std::move(it));
      }
      const Deadline dl = deadline_after(std::min(timeout_s_, 0.5));
      std::vector<uint8_t> want_rx(rails_.size(), 0), want_tx(rails_.size(), 1), rx, tx;
      for (;;) {
        bool busy = false;
        for (int r = 0; r < nr(); ++r) {
          if (tr_->up(r)) pump_tx(r);
          if (tr_->up(r) && !rails_[size_t(r)].txq.empty()) busy = true;
        }
        if (!busy || Clock::now() >= dl) break;
        tr_->wait(want_rx, want_tx, 5, rx, tx);
      }
    } catch (...) {
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return 2; }

  void all_reduce(void* data, size_t count, DType dtype) override {
    std::lock_guard<std::mutex> lk(op_mu_);
    check_usable();
    const size_t bytes = count * dtype_size(dtype);
    ensure_scratch(bytes);
    Op op;
    op.kind = kAllReduce;
    op.has_send = op.has_recv = true;
    op.src = static_cast<const uint8_t*>(data);
    op.send_bytes = op.recv_bytes = bytes;
    op.dst = scratch_.get();
    run_op(op, [&] { reduce_into(static_cast<uint8_t*>(data), scratch_.get(), count, dtype, rank_); });
  }

  void broadcast(void* data, size_t bytes, int root) override { broadcast_impl(data, bytes, root, false); }
  void broadcast_idle(void* data, size_t bytes, int root) override {
    TF_CHECK(root != rank_, "broadcast_idle is for the receiving rank");
    broadcast_impl(data, bytes, root, true);
  }

  void broadcast_impl(void* data, size_t bytes, int root, bool idle) {
    std::lock_guard<std::mutex> lk(op_mu_);
    TF_CHECK(root == 0 || root == 1, "broadcast root ", root, " out of range for a group of size 2");
    check_usable();
    Op op;
    op.kind = kBroadcast;
    op.idle = idle;
    if (root == rank_) {
      op.has_send = true;
      op.src = static_cast<const uint8_t*>(data);
      op.send_bytes = bytes;
    } else {
      op.has_recv = true;
      op.dst = static_cast<uint8_t*>(data);
      op.recv_bytes = bytes;
    }
    run_op(op, [] {});
  }

  void barrier() override {
    std::lock_guard<std::mutex> lk(op_mu_);
    check_usable();
    Op op;
    op.kind = kBarrier;
    op.has_send = op.has_recv = true;
    run_op(op, [] {});
  }

  GroupStats stats() const override {
    std::lock_guard<std::mutex> lk(stats_mu_);
    return stats_;
  }

  void debug_fail_rail(int rail, uint64_t after_bytes) override {
    TF_CHECK(rail >= 0 && rail < nr(), "rail ", rail, " out of range (", nr(), " rails)");
    fail_after_[rail].store(static_cast<int64_t>(after_bytes));
  }

 private:
  int nr() const { return static_cast<int>(rails_.size()); }

  void check_usable() const {
    if (!broken_.empty())
      fail(ErrorKind::Runtime, "comm group is unusable after an earlier error: ", broken_);
  }

  void ensure_scratch(size_t bytes) {
    if (bytes > scratch_cap_) {
      scratch_.reset(new uint8_t[bytes]);
      scratch_cap_ = bytes;
    }
  }

  size_t chunk_for(size_t total) const {
    return total <= small_ ? std::max<size_t>(total, 1) : chunk_;
  }
  uint32_t chunks_for(size_t total) const {
    const size_t c = chunk_for(total);
    return static_cast<uint32_t>(total == 0 ? 1 : (total + c - 1) / c);
  }

  template <typename Finish>
  void run_op(Op& op, Finish finish) {
    const auto t0 = Clock::now();
    op.seq = ++seq_;
    try {
      start_op(op);
      progress_until_done(op);
      finish();
    } catch (const Error& e) {
      broken_ = e.what();
      account(op, t0);
      throw;
    }
    account(op, t0);
  }

  void account(const Op& op, Clock::time_point t0) {
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    std::lock_guard<std::mutex> lk(stats_mu_);
    if (op.kind == kAllReduce) ++stats_.all_reduces;
    if (op.kind == kBroadcast) ++stats_.broadcasts;
    if (op.kind == kBarrier) ++stats_.barriers;
    if (op.has_send && !op.large) ++stats_.small_messages;
    stats_.seconds_in_collectives += dt;
    stats_.rail_failures = rail_failures_;
    fill_rail_stats(stats_);
  }

  void publish_stats() {
    std::lock_guard<std::mutex> lk(stats_mu_);
    fill_rail_stats(stats_);
  }

  void fill_rail_stats(GroupStats& s) const {
    s.rails.resize(rails_.size());
    for (int r = 0; r < nr(); ++r) {
      RailStats& rs = s.rails[size_t(r)];
      rs.local = tr_->local_addr(r);
      rs.peer = tr_->peer_addr(r);
      rs.up = tr_->up(r);
      rs.bytes_sent = rails_[size_t(r)].bytes_sent;
      rs.bytes_received = rails_[size_t(r)].bytes_received;
      rs.throughput_mb_s = rails_[size_t(r)].ewma_mb_s;
      rs.down_reason = tr_->down_reason(r);
    }
  }

  int first_live() const {
    for (int r = 0; r < nr(); ++r)
      if (tr_->up(r)) return r;
    return -1;
  }

  // ---- setting up a collective -------------------------------------------------------
  void start_op(Op& op) {
    TF_COMM_TRACE("op %llu %s send=%zu recv=%zu acked=%llu recv_done=%llu stash=%zu retained=%zu",
                  (unsigned long long)op.seq, kind_name(op.kind), op.has_send ? op.send_bytes : size_t(-1),
                  op.has_recv ? op.recv_bytes : size_t(-1), (unsigned long long)acked_,
                  (unsigned long long)recv_done_, stash_.size(), retained_.size());
    if (op.has_recv) {
      op.recv_chunk = chunk_for(op.recv_bytes);
      op.recv_chunks = chunks_for(op.recv_bytes);
      op.got.assign(op.recv_chunks, 0);
    }
    for (auto& rs : rails_) {
      rs.pending.clear();
      rs.assigned.clear();
      rs.op_bytes = 0;
    }
    // Messages that arrived early for this collective.
    std::vector<Stashed> keep;
    for (auto& st : stash_) {
      if (st.h.seq == op.seq) {
        uint8_t* dst = accept_data(op, st.h);
        if (dst) {
          if (st.h.len) std::memcpy(dst, st.data->data(), st.h.len);
          mark_received(op, st.h);
        }
      } else if (st.h.seq > op.seq) {
        keep.push_back(std::move(st));
      }
    }
    stash_.swap(keep);

    if (!op.has_send) return;
    op.large = op.send_bytes > small_;
    const int live = first_live();
    if (live < 0) lost_peer("no live rails");
    if (!op.large) {
      Retained rt;
      rt.seq = op.seq;
      rt.h = {kMsgMagic, kData | op.kind << 8, op.seq, op.send_bytes, 0, op.send_bytes};
      rt.data = std::make_shared<std::vector<uint8_t>>(op.src, op.src + op.send_bytes);
      rt.rail = live;
      enqueue_retained(rt, live);
      retained_.push_back(std::move(rt));
      return;
    }
    // Large: stripe the chunks over the live rails in proportion to measured throughput.
    const uint32_t n = chunks_for(op.send_bytes);
    std::vector<int> live_rails;
    double wsum = 0;
    bool all_measured = true;
    for (int r = 0; r < nr(); ++r) {
      if (!tr_->up(r)) continue;
      live_rails.push_back(r);
      wsum += rails_[size_t(r)].ewma_mb_s;
      if (rails_[size_t(r)].ewma_mb_s <= 0) all_measured = false;
    }
    uint32_t next = 0;
    for (size_t i = 0; i < live_rails.size(); ++i) {
      const int r = live_rails[i];
      const double w = all_measured ? rails_[size_t(r)].ewma_mb_s / wsum : 1.0 / double(live_rails.size());
      uint32_t cnt = i + 1 == live_rails.size()
                         ? n - next
                         : std::min<uint32_t>(n - next, static_cast<uint32_t>(std::lround(w * n)));
      for (uint32_t c = 0; c < cnt; ++c) rails_[size_t(r)].pending.push_back(next++);
    }
  }

  void enqueue_retained(const Retained& rt, int rail) {
    TF_COMM_TRACE("enqueue small seq=%llu len=%llu on rail %d", (unsigned long long)rt.seq,
                  (unsigned long long)rt.h.len, rail);
    TxItem it;
    it.h = rt.h;
    it.keep = rt.data;
    it.body = rt.data->data();
    rails_[size_t(rail)].txq.push_back(std::move(it));
  }

  void enqueue_done(uint64_t seq, int rail) {
    TF_COMM_TRACE("enqueue DONE %llu on rail %d", (unsigned long long)seq, rail);
    TxItem it;
    it.h = {kMsgMagic, kDone, seq, 0, 0, 0};
    rails_[size_t(rail)].txq.push_back(std::move(it));
  }

  // Queue large chunks so each live rail has a couple waiting; steal when a rail runs dry.
  void refill(Op& op) {
    if (!op.large || acked_ >= op.seq) return;
    for (int r = 0; r < nr(); ++r) {
      if (!tr_->up(r)) continue;
      RailState& rs = rails_[size_t(r)];
      int queued = 0;
      for (const auto& it : rs.txq)
        if (it.user_mem && it.sent == 0) ++queued;
      while (queued < 2) {
        uint32_t c;
        if (!rs.pending.empty()) {
          c = rs.pending.front();
          rs.pending.pop_front();
        } else {
          RailState* victim = nullptr;
          for (auto& o : rails_)
            if (&o != &rs && o.pending.size() > 1 && (!victim || o.pending.size() > victim->pending.size()))
              victim = &o;
          if (!victim) break;
          c = victim->pending.back();
          victim->pending.pop_back();
        }
        const size_t off = size_t(c) * chunk_;
        const size_t len = std::min(chunk_, op.send_bytes - off);
        TxItem it;
        it.h = {kMsgMagic, kData | op.kind << 8, op.seq, op.send_bytes, off, len};
        it.body = op.src + off;
        it.user_mem = true;
        it.chunk = c;
        TF_COMM_TRACE("enqueue chunk %u of op %llu on rail %d", c, (unsigned long long)op.seq, r);
        rs.txq.push_back(std::move(it));
        rs.assigned.push_back(c);
        ++queued;
      }
    }
  }

  // ---- receiving -----------------------------------------------------------------------
  [[noreturn]] void mismatch(const Op& op, const Header& h, const std::string& why) {
    std::ostringstream os;
    os << "collective mismatch at collective #" << op.seq << ": peer sent " << kind_name(h.type >> 8)
       << " data (" << h.total << " bytes), this rank is in " << kind_name(op.kind);
    if (op.has_recv) os << " expecting " << op.recv_bytes << " bytes";
    else os << " as the sender";
    os << " (" << why << "); both ranks must make the same calls in the same order";
    fail(ErrorKind::InvalidInput, os.str());
  }

  // Destination for a DATA message of the current collective, or nullptr if it's a duplicate.
  uint8_t* accept_data(Op& op, const Header& h) {
    if ((h.type >> 8) != op.kind) mismatch(op, h, "different collective");
    if (!op.has_recv) mismatch(op, h, "this rank expects no data");
    if (h.total != op.recv_bytes) mismatch(op, h, "different size");
    const size_t c = op.recv_chunk;
    const size_t idx = h.offset / c;
    const size_t want = std::min(c, op.recv_bytes - std::min(op.recv_bytes, idx * c));
    if (h.offset % c != 0 || idx >= op.recv_chunks || h.len != (op.recv_bytes ? want : 0))
      mismatch(op, h, "inconsistent chunking");
    if (op.got[idx]) return nullptr;
    return op.dst ? op.dst + h.offset : reinterpret_cast<uint8_t*>(&trash_[0]);
  }

  void mark_received(Op& op, const Header& h) {
    const size_t idx = h.offset / op.recv_chunk;
    if (!op.got[idx]) {
      op.got[idx] = 1;
      ++op.recv_got;
    }
  }

  void note_ack(uint64_t seq) {
    if (seq <= acked_) return;
    acked_ = seq;
    while (!retained_.empty() && retained_.front().seq <= acked_) retained_.pop_front();
  }

  void on_header(Op& op, int r) {
    RailState& rs = rails_[size_t(r)];
    const Header& h = rs.rh;
    if (h.magic != kMsgMagic || (h.type != kDone && h.type != kBye && (h.type & 0xff) != kData)) {
      tr_->fail_rail(r, "protocol error (bad message header)");
      return;
    }
    TF_COMM_TRACE("rail %d got %s seq=%llu off=%llu len=%llu (in op %llu)", r, h.type == kDone ? "DONE" : "DATA",
                  (unsigned long long)h.seq, (unsigned long long)h.offset, (unsigned long long)h.len,
                  (unsigned long long)op.seq);
    if (h.type == kBye) {
      peer_closed_ = true;
      rs.rh_got = 0;
      tr_->fail_rail(r, "peer closed the group");
      return;
    }
    if (h.type == kDone) {
      note_ack(h.seq);
      rs.rh_got = 0;
      return;
    }
    if (h.seq > 0) note_ack(h.seq - 1);
    rs.in_body = true;
    rs.body_got = 0;
    rs.sink = Sink::Discard;
    if (h.seq == op.seq) {
      if (uint8_t* dst = accept_data(op, h)) {
        rs.sink = Sink::Dst;
        rs.sink_ptr = dst;
      }
    } else if (h.seq > op.seq) {
      if (h.len > (uint64_t(1) << 34)) {
        tr_->fail_rail(r, "protocol error (oversized message)");
        return;
      }
      rs.sink = Sink::Stash;
      rs.stash_buf = std::make_shared<std::vector<uint8_t>>(h.len);
      rs.sink_ptr = rs.stash_buf->data();
    }
    if (h.len == 0) on_body_done(op, r);
  }

  void on_body_done(Op& op, int r) {
    RailState& rs = rails_[size_t(r)];
    if (rs.sink == Sink::Dst) mark_received(op, rs.rh);
    if (rs.sink == Sink::Stash) stash_.push_back({rs.rh, std::move(rs.stash_buf)});
    rs.stash_buf.reset();
    rs.in_body = false;
    rs.rh_got = 0;
  }

  // True once this collective needs nothing more from the peer.
  bool complete_able(const Op& op) const {
    return recv_complete(op) && (!op.has_send || !op.large || acked_ >= op.seq);
  }
  bool tx_idle(const Op& op) const {
    for (const auto& rs : rails_)
      for (const auto& it : rs.txq)
        if (!(it.user_mem && it.sent == 0 && acked_ >= op.seq)) return false;
    return true;
  }

  bool pump_rx(Op& op, int r) {
    RailState& rs = rails_[size_t(r)];
    bool progressed = false;
    // Leave later input (the next collective, or the peer's goodbye after its last one) in
    // the socket once this collective is finished.
    if (complete_able(op) && tx_idle(op)) return false;
    size_t budget = size_t(8) << 20;
    while (budget > 0 && tr_->up(r)) {
      long k;
      if (!rs.in_body) {
        k = tr_->recv_some(r, reinterpret_cast<uint8_t*>(&rs.rh) + rs.rh_got, sizeof(Header) - rs.rh_got);
        if (k <= 0) break;
        rs.rh_got += size_t(k);
        if (rs.rh_got == sizeof(Header)) {
          on_header(op, r);
          if (!rs.in_body && rs.rh_got == 0 && complete_able(op)) budget = 0;
        }
      } else {
        const size_t left = rs.rh.len - rs.body_got;
        if (rs.sink == Sink::Discard)
          k = tr_->recv_some(r, trash_, std::min(left, sizeof trash_));
        else
          k = tr_->recv_some(r, rs.sink_ptr + rs.body_got, std::min(left, budget));
        if (k <= 0) break;
        rs.body_got += size_t(k);
        if (rs.body_got == rs.rh.len) {
          on_body_done(op, r);
          if (complete_able(op)) budget = 0;
        }
      }
      rs.bytes_received += uint64_t(k);
      budget -= std::min(budget, size_t(k));
      progressed = true;
    }
    return progressed;
  }

  // ---- sending -------------------------------------------------------------------------
  bool pump_tx(int r) {
    RailState& rs = rails_[size_t(r)];
    bool progressed = false;
    size_t budget = size_t(8) << 20;
    while (budget > 0 && !rs.txq.empty() && tr_->up(r)) {
      TxItem& it = rs.txq.front();
      const uint8_t* hp = reinterpret_cast<const uint8_t*>(&it.h);
      size_t hn = 0, boff = 0;
      if (it.sent < sizeof(Header)) {
        hp += it.sent;
        hn = sizeof(Header) - it.sent;
      } else {
        boff = it.sent - sizeof(Header);
      }
      const size_t bn = std::min<size_t>(it.h.len - boff, budget);
      const long k = tr_->send_some(r, hp, hn, it.body + boff, bn);
      if (k <= 0) break;
      const auto now = Clock::now();
      if (rs.op_bytes == 0) rs.op_first = now;
      rs.op_last = now;
      rs.last_tx_progress = now;
      rs.op_bytes += uint64_t(k);
      rs.bytes_sent += uint64_t(k);
      it.sent += size_t(k);
      budget -= std::min(budget, size_t(k));
      progressed = true;
      if (it.sent == it.size()) rs.txq.pop_front();
    }
    return progressed;
  }

  // ---- failures ------------------------------------------------------------------------
  [[noreturn]] void lost_peer(const std::string& why) {
    std::ostringstream os;
    os << "peer lost: " << why;
    for (int r = 0; r < nr(); ++r)
      os << "; rail " << r << " (" << tr_->local_addr(r) << " -> " << tr_->peer_addr(r)
         << "): " << (tr_->up(r) ? "up" : tr_->down_reason(r));
    fail(ErrorKind::Runtime, os.str());
  }

  // Moves the work of newly failed rails to the live ones. Returns false if none is left.
  bool handle_down(Op& op) {
    for (int r = 0; r < nr(); ++r) {
      RailState& rs = rails_[size_t(r)];
      if (tr_->up(r) || rs.handled_down) continue;
      rs.handled_down = true;
      if (!peer_closed_) ++rail_failures_;
      TF_COMM_TRACE("rail %d down: %s (txq=%zu assigned=%zu)", r, tr_->down_reason(r).c_str(), rs.txq.size(),
                    rs.assigned.size());
      rs.txq.clear();
      rs.in_body = false;
      rs.rh_got = 0;
      rs.stash_buf.reset();
      const int to = first_live();
      if (to < 0) {
        rs.assigned.clear();
        rs.pending.clear();
        continue;
      }
      // Chunks queued on the dead rail may or may not have arrived: send them all again.
      if (op.large && acked_ < op.seq) {
        RailState& dst = rails_[size_t(to)];
        for (uint32_t c : rs.assigned) dst.pending.push_back(c);
        for (uint32_t c : rs.pending) dst.pending.push_back(c);
      }
      rs.assigned.clear();
      rs.pending.clear();
      for (auto& rt : retained_) {
        if (rt.rail != r) continue;
        rt.rail = to;
        enqueue_retained(rt, to);
      }
      if (recv_done_ > 0) enqueue_done(recv_done_, to);
    }
    return first_live() >= 0;
  }

  void check_stalls(Clock::time_point now, Clock::time_point last_progress) {
    // A rail with queued output that has not moved for half the timeout while another rail
    // kept moving is treated as lost (a silently dead link never reports an error).
    const auto stall = std::chrono::duration<double>(timeout_s_ / 2);
    // Nothing moved at all for half the timeout while two or more rails are up, and a small
    // message of ours is unacknowledged: it is sitting in a dead link's socket buffer. Both
    // ranks get here; each drops that rail and handle_down() re-sends on the others
    // (duplicates are dropped). Large messages rely on the rails' TCP_USER_TIMEOUT instead.
    int live = 0;
    for (int r = 0; r < nr(); ++r) live += tr_->up(r) ? 1 : 0;
    if (now - last_progress > stall && live >= 2) {
      for (const auto& rt : retained_)
        if (tr_->up(rt.rail)) {
          tr_->fail_rail(rt.rail, "stalled (nothing moved for half the timeout)");
          return;
        }
    }
    Clock::time_point best{};
    for (int r = 0; r < nr(); ++r)
      if (tr_->up(r)) best = std::max(best, rails_[size_t(r)].last_tx_progress);
    for (int r = 0; r < nr(); ++r) {
      RailState& rs = rails_[size_t(r)];
      if (!tr_->up(r) || rs.txq.empty()) continue;
      if (now - rs.last_tx_progress > stall && best - rs.last_tx_progress > stall / 2)
        tr_->fail_rail(r, "stalled (no progress while other rails moved)");
    }
  }

  void check_injected() {
    for (int r = 0; r < nr(); ++r) {
      const int64_t after = fail_after_[r].load(std::memory_order_relaxed);
      if (after < 0 || !tr_->up(r)) continue;
      if (rails_[size_t(r)].op_bytes >= uint64_t(after)) {
        fail_after_[r].store(-1);
        tr_->fail_rail(r, "failure injected by test hook");
      }
    }
  }

  // ---- the progress loop ---------------------------------------------------------------
  bool recv_complete(const Op& op) const { return !op.has_recv || op.recv_got == op.recv_chunks; }

  void progress_until_done(Op& op) {
    const auto timeout = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s_));
    auto now = Clock::now();
    auto last_progress = now;
    for (int r = 0; r < nr(); ++r) rails_[size_t(r)].last_tx_progress = now;
    // Small exchanges busy-poll briefly before sleeping in poll(): the answer is usually
    // only a few microseconds away.
    const auto spin_until = now + std::chrono::microseconds(op.large ? 0 : spin_us_);
    const size_t n_rails = rails_.size();
    std::vector<uint8_t> want_rx(n_rails), want_tx(n_rails), rdy_rx, rdy_tx;
    for (;;) {
      bool progressed = false;
      refill(op);
      for (int r = 0; r < nr(); ++r) {
        if (!tr_->up(r)) continue;
        progressed |= pump_tx(r);
        if (pump_rx(op, r)) progressed = op.rx_started = true;
      }
      check_injected();
      const bool any_live = handle_down(op);

      if (recv_complete(op) && !op.recv_announced && op.has_recv && any_live) {
        op.recv_announced = true;
        recv_done_ = op.seq;
        // Explicit ack when the peer waits for one (large message) or would otherwise get
        // no implicit ack soon (this rank sends nothing in this collective).
        if (op.recv_bytes > small_ || !op.has_send) enqueue_done(op.seq, first_live());
        progressed = true;
      }
      const bool send_ok = !op.has_send || !op.large || acked_ >= op.seq;
      if (recv_complete(op) && send_ok) {
        if (!op.has_recv) recv_done_ = std::max(recv_done_, op.seq);
        // Drop duplicate chunks not yet started; finish any that are half written.
        bool idle = true;
        for (int r = 0; r < nr(); ++r) {
          auto& q = rails_[size_t(r)].txq;
          q.erase(std::remove_if(q.begin(), q.end(),
                                 [&](const TxItem& it) { return it.user_mem && it.sent == 0; }),
                  q.end());
          if (!q.empty()) idle = false;
          rails_[size_t(r)].pending.clear();
        }
        if (idle) break;
      }
      // Checked after completion: a peer that finished and closed is not an error for a
      // collective that got everything it needed.
      if (!any_live) lost_peer("all rails are down");

      now = Clock::now();
      if (progressed) {
        last_progress = now;
        continue;
      }
      if (now < spin_until) continue;
      if (now - last_progress > timeout)
        lost_peer("no progress for " + std::to_string(timeout_s_) + " s (collective #" +
                  std::to_string(op.seq) + " " + kind_name(op.kind) + ")");
      check_stalls(now, last_progress);
      for (int r = 0; r < nr(); ++r) {
        want_rx[size_t(r)] = 1;
        want_tx[size_t(r)] = !rails_[size_t(r)].txq.empty();
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(timeout - (now - last_progress));
      int ms = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(left.count() + 1, 100)));
      if (op.idle && !op.rx_started && op.recv_got == 0) {
        // Nothing of this collective has arrived: the peer has not started it, so stopping
        // here interrupts no exchange (the group is unusable afterwards all the same).
        check_interrupt();
        ms = std::min(ms, 50);
      }
      tr_->wait(want_rx, want_tx, ms, rdy_rx, rdy_tx);
    }
    // Input still arriving for this collective can only be a duplicate now; never let it
    // write into the caller's buffer after we return.
    for (auto& rs : rails_)
      if (rs.in_body && rs.sink == Sink::Dst) rs.sink = Sink::Discard;
    // Fold this collective's per-rail rate into the striping weights.
    if (op.large) {
      for (auto& rs : rails_) {
        if (rs.op_bytes < 2 * chunk_) continue;
        const double dt = std::chrono::duration<double>(rs.op_last - rs.op_first).count();
        if (dt <= 0) continue;
        const double mbs = double(rs.op_bytes) / dt / 1e6;
        rs.ewma_mb_s = rs.ewma_mb_s <= 0 ? mbs : 0.7 * rs.ewma_mb_s + 0.3 * mbs;
      }
    }
  }

  const int rank_;
  const double timeout_s_;
  const size_t small_, chunk_;
  const int spin_us_ = 50;
  std::unique_ptr<Transport> tr_;
  std::vector<RailState> rails_;
  std::unique_ptr<std::atomic<int64_t>[]> fail_after_;

  std::mutex op_mu_;
  mutable std::mutex stats_mu_;
  GroupStats stats_;
  uint64_t rail_failures_ = 0;
  std::string broken_;
  bool peer_closed_ = false;

  uint64_t seq_ = 0;        // collectives started
  uint64_t acked_ = 0;      // peer has all our data up to this collective
  uint64_t recv_done_ = 0;  // we have all the peer's data up to this collective
  std::deque<Retained> retained_;
  std::vector<Stashed> stash_;
  std::unique_ptr<uint8_t[]> scratch_;
  size_t scratch_cap_ = 0;
  uint8_t trash_[64 * 1024];
};

// ---------------------------------------------------------------------------------------
// Handshake, three messages each way on the bootstrap link, both ranks checking the same way:
//   1. hello: protocol, configuration and a fresh random nonce;
//   2. proof: "proof <HMAC-SHA256(token, auth text)>" or "proof none" without a token, where the
//      auth text names both nonces (rank 0's first) and the sender's rank, so a proof is good
//      for this session and direction only and never reveals the token;
//   3. verdict: "ok" or "reject <why>", so a mismatch is reported on both ranks.
// Rank 0 runs it on every connection it accepts (several at once) and keeps listening after a
// failure.
constexpr size_t kMaxHelloBytes = size_t(64) << 10;
constexpr double kCandidateSeconds = 3.0;  // rank 0: time one connection gets to pass the handshake
constexpr size_t kMaxCandidates = 64;       // rank 0: connections in their handshake at once

std::string hello_text(const GroupOptions& o, int n_rails, const std::string& nonce) {
  std::ostringstream os;
  const uint16_t probe = 1;
  const bool little = *reinterpret_cast<const uint8_t*>(&probe) == 1;
  os << kProtocol << "\n"
     << "endian " << (little ? "little" : "big") << "\n"
     << "size " << o.size << "\n"
     << "rank " << o.rank << "\n"
     << "transport " << o.transport << "\n"
     << "dtypes f32,f16,bf16\n"
     << "rails " << n_rails << "\n"
     << "small " << o.small_bytes << "\n"
     << "chunk " << o.chunk_bytes << "\n"
     << "nonce " << nonce << "\n"
     << "auth " << (o.token.empty() ? "none" : "token") << "\n"
     << "handshake " << o.handshake;
  return os.str();
}

std::map<std::string, std::string> parse_hello(const std::string& s) {
  std::map<std::string, std::string> kv;
  size_t pos = s.find('\n');
  kv["protocol"] = s.substr(0, pos);
  while (pos != std::string::npos) {
    const size_t start = pos + 1;
    const size_t sp = s.find(' ', start);
    if (sp == std::string::npos) break;
    const std::string key = s.substr(start, sp - start);
    if (key == "handshake") {  // free text, always last
      kv[key] = s.substr(sp + 1);
      break;
    }
    pos = s.find('\n', sp);
    kv[key] = s.substr(sp + 1, pos == std::string::npos ? std::string::npos : pos - sp - 1);
  }
  return kv;
}

// Peer text fit for a message: at most 200 characters, control characters replaced.
std::string printable(const std::string& s) {
  std::string t = s.size() <= 200 ? s : s.substr(0, 200) + "...";
  for (char& c : t)
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) == 0x7f) c = '?';
  return t;
}

std::string clip(const std::string& s) { return "'" + printable(s) + "'"; }

std::string random_nonce() {
  std::random_device rd;
  uint8_t b[16];
  for (int i = 0; i < 16; i += 4) {
    const uint32_t v = rd();
    std::memcpy(b + i, &v, 4);
  }
  return to_hex(b, sizeof b);
}

bool is_nonce(const std::string& s) {
  if (s.size() != 32) return false;
  for (char c : s)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

std::string auth_proof(const std::string& token, const std::string& nonce0, const std::string& nonce1,
                       int sender_rank) {
  const std::string text = std::string("tensorfold-comm auth v1\n") + nonce0 + "\n" + nonce1 + "\nrank " +
                           std::to_string(sender_rank);
  const Digest256 mac = hmac_sha256(token, text);
  return to_hex(mac.data(), mac.size());
}

bool all_digits(const std::string& s, size_t max_len) {
  if (s.empty() || s.size() > max_len) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  return true;
}

// Names what differs between two handshake texts (GroupOptions::handshake_hints): "context 256
// here, 128 on the peer; start both ranks with the same -c/--context". Empty when they differ
// in anything but the values of KEY=VALUE items (another version or layout of the text).
std::string explain_mismatch(const std::string& mine, const std::string& peer,
                             const std::map<std::string, GroupOptions::HandshakeHint>& hints) {
  auto items = [](const std::string& s) {
    std::vector<std::string> v;
    std::istringstream is(s);
    for (std::string t; is >> t;) v.push_back(t);
    return v;
  };
  const std::vector<std::string> a = items(mine), b = items(peer);
  if (a.size() != b.size()) return "";
  std::string named, fixes;
  std::set<std::string> seen_fixes;
  int n_named = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] == b[i]) continue;
    const size_t ea = a[i].find('='), eb = b[i].find('=');
    if (ea == std::string::npos || ea == 0 || eb != ea || a[i].compare(0, ea, b[i], 0, eb) != 0) return "";
    if (++n_named > 8) return "";  // not a configuration that differs in a few options
    const std::string key = a[i].substr(0, ea);
    const auto h = hints.find(key);
    const std::string label = h != hints.end() && !h->second.label.empty() ? h->second.label : key;
    named += (named.empty() ? "" : "; ") + label + " " + printable(a[i].substr(ea + 1)) + " here, " +
             printable(b[i].substr(ea + 1)) + " on the peer";
    if (h != hints.end() && !h->second.fix.empty() && seen_fixes.insert(h->second.fix).second)
      fixes += (fixes.empty() ? "" : " and ") + h->second.fix;
  }
  if (named.empty()) return "";
  return fixes.empty() ? named : named + "; start both ranks with " + fixes;
}

struct Agreed {
  size_t small_bytes = 0, chunk_bytes = 0;
  int n_rails = 1;
};

// Runs the handshake on one bootstrap link. Throws tf::Error saying what did not match.
Agreed handshake(const GroupOptions& opts, Bootstrap& boot, Deadline dl, int my_rails) {
  const std::string my_nonce = random_nonce();
  const std::string my_hello = hello_text(opts, my_rails, my_nonce);
  boot.send_msg(my_hello, dl);
  const std::string peer_text = boot.recv_msg(dl, kMaxHelloBytes);
  if (peer_text.compare(0, 16, "tensorfold-comm ") != 0)
    fail(ErrorKind::Runtime, "not a TensorFold comm peer (its first message is not a comm hello)");
  auto peer = parse_hello(peer_text);
  auto mine = parse_hello(my_hello);
  if (peer["protocol"] != mine["protocol"]) {
    const std::string problem = "peer speaks a different comm protocol version: this rank has " +
                                clip(mine["protocol"]) + ", peer (" + boot.peer_addr() + ") has " +
                                clip(peer["protocol"]);
    try {
      boot.send_msg("reject " + problem, dl);  // an older peer reads this as the verdict
    } catch (const Error& e) {
      if (e.kind() == ErrorKind::Interrupted) throw;
    }
    fail(ErrorKind::InvalidInput, "comm handshake failed: ", problem);
  }
  const std::string& peer_nonce = peer["nonce"];
  const std::string& n0 = opts.rank == 0 ? my_nonce : peer_nonce;
  const std::string& n1 = opts.rank == 0 ? peer_nonce : my_nonce;
  boot.send_msg(opts.token.empty() ? "proof none" : "proof " + auth_proof(opts.token, n0, n1, opts.rank), dl);
  const std::string peer_proof = boot.recv_msg(dl, 1024);

  std::string problem;
  auto check = [&](const std::string& key, const std::string& what) {
    if (!problem.empty()) return;
    if (peer[key] != mine[key])
      problem = what + ": this rank has " + clip(mine[key]) + ", peer (" + boot.peer_addr() +
                ") has " + clip(peer[key]);
  };
  // Authentication first: an unauthenticated peer learns nothing more about this rank.
  if (!is_nonce(peer_nonce) || peer_proof.compare(0, 6, "proof ") != 0) {
    problem = "peer (" + boot.peer_addr() + ") sent a malformed handshake";
  } else if (!opts.token.empty() && peer_proof == "proof none") {
    problem = "peer (" + boot.peer_addr() +
              ") gave no token, but this rank requires one (give both ranks the same --token or "
              "TENSORFOLD_TP_TOKEN)";
  } else if (opts.token.empty() && peer_proof != "proof none") {
    problem = "peer (" + boot.peer_addr() +
              ") requires a token, but this rank has none (give both ranks the same --token or "
              "TENSORFOLD_TP_TOKEN)";
  } else if (!opts.token.empty() &&
             !equal_ct(peer_proof.substr(6), auth_proof(opts.token, n0, n1, 1 - opts.rank))) {
    problem = "token mismatch: peer (" + boot.peer_addr() + ") does not know this rank's token";
  }
  check("endian", "peer has a different byte order");
  check("size", "peer's group size differs");
  check("transport", "peer's transport differs");
  check("dtypes", "peer supports different dtypes");
  if (problem.empty() && peer["handshake"] != mine["handshake"]) {
    const std::string why = explain_mismatch(mine["handshake"], peer["handshake"], opts.handshake_hints);
    problem = why.empty() ? "peer's handshake (model hash / TP config) differs: this rank has " +
                                clip(mine["handshake"]) + ", peer (" + boot.peer_addr() + ") has " +
                                clip(peer["handshake"])
                          : "the configuration of the peer (" + boot.peer_addr() + ") differs: " + why;
  }
  if (problem.empty() && peer["rank"] != std::to_string(1 - opts.rank))
    problem = "both ranks claim to be " + opts.self_name + " (peer " + boot.peer_addr() + ")";
  if (problem.empty() && (!all_digits(peer["small"], 12) || !all_digits(peer["chunk"], 12) ||
                          !all_digits(peer["rails"], 2)))
    problem = "peer (" + boot.peer_addr() + ") sent a malformed handshake";
  Agreed a;
  if (problem.empty()) {
    // Rank 0's tuning wins so both sides chunk identically.
    const auto num = [](const std::string& v) { return static_cast<size_t>(std::stoull(v)); };
    a.small_bytes = opts.rank == 0 ? opts.small_bytes : num(peer["small"]);
    a.chunk_bytes = opts.rank == 0 ? opts.chunk_bytes : num(peer["chunk"]);
    const size_t peer_rails = num(peer["rails"]);
    a.n_rails = std::min(my_rails, static_cast<int>(std::min<size_t>(peer_rails, 8)));
    if (a.small_bytes > (size_t(64) << 20) || a.chunk_bytes < 4096 || a.chunk_bytes > (size_t(256) << 20) ||
        a.n_rails < 1)
      problem = "peer (" + boot.peer_addr() + ") proposed invalid comm tuning (small " + peer["small"] +
                ", chunk " + peer["chunk"] + ", rails " + peer["rails"] + ")";
  }
  boot.send_msg(problem.empty() ? "ok" : "reject " + problem, dl);
  const std::string verdict = boot.recv_msg(dl, kMaxHelloBytes);
  if (!problem.empty()) fail(ErrorKind::InvalidInput, "comm handshake failed: ", problem);
  if (verdict != "ok")
    fail(ErrorKind::InvalidInput, "comm handshake failed: peer rejected it: ",
         verdict.compare(0, 7, "reject ") == 0 ? verdict.substr(7) : clip(verdict));
  return a;
}

// One connection in its handshake, on a thread of its own: the listening rank serves several
// at once, so connections that stay silent cannot hold the peer out. Destroying it unblocks
// the handshake (shutdown of the link) and joins the thread.
struct Candidate {
  std::unique_ptr<Bootstrap> boot;
  std::string from;
  std::thread th;
  std::atomic<bool> finished{false};
  bool passed = false, interrupted = false;
  Agreed agreed;
  std::string error;  // why it failed

  ~Candidate() {
    if (!th.joinable()) return;
    boot->abort();
    th.join();
  }
};

std::unique_ptr<Candidate> start_candidate(const GroupOptions& opts, std::unique_ptr<Bootstrap> boot,
                                           int my_rails) {
  auto c = std::make_unique<Candidate>();
  c->boot = std::move(boot);
  c->from = c->boot->peer_addr();
  const Deadline cdl = deadline_after(std::min(kCandidateSeconds, opts.timeout_s));
  Candidate* cp = c.get();
  // Nothing may escape a thread body (std::terminate): every outcome is recorded.
  c->th = std::thread([cp, &opts, cdl, my_rails] {
    try {
      cp->agreed = handshake(opts, *cp->boot, cdl, my_rails);
      cp->passed = true;
    } catch (const Error& e) {
      cp->error = e.what();
      cp->interrupted = e.kind() == ErrorKind::Interrupted;
    } catch (const std::exception& e) {
      cp->error = e.what();
    } catch (...) {
      cp->error = "unknown error";
    }
    cp->finished.store(true, std::memory_order_release);
  });
  return c;
}

}  // namespace

// ---------------------------------------------------------------------------------------
RejectLog::RejectLog(std::string where, std::string waiting_for)
    : where_(std::move(where)), waiting_for_(std::move(waiting_for)), last_line_(Clock::now()) {}

void RejectLog::reject(const std::string& from, const std::string& why, bool still_waiting) {
  ++count_;
  last_ = from + " (" + why + ")";
  last_from_ = from;
  last_why_ = why;
  if (count_ <= kMaxRejectLogs) {
    std::fprintf(stderr, "tensorfold comm: rejected a connection on %s from %s%s%s%s\n", where_.c_str(),
                 last_.c_str(), still_waiting ? "; still waiting for " : "",
                 still_waiting ? waiting_for_.c_str() : "",
                 count_ == kMaxRejectLogs ? " (further rejections are summarised every 10 s)" : "");
    last_line_ = Clock::now();
    return;
  }
  ++unlogged_;
  tick();
}

void RejectLog::tick() {
  if (unlogged_ > 0 && Clock::now() - last_line_ >= std::chrono::duration<double>(kRejectSummarySeconds)) summarise();
}

void RejectLog::finish() {
  if (unlogged_ > 0) summarise();
}

void RejectLog::summarise() {
  const auto now = Clock::now();
  const double secs = std::max(1.0, std::round(std::chrono::duration<double>(now - last_line_).count()));
  std::fprintf(stderr,
               "tensorfold comm: rejected %d more connection(s) on %s in the last %.0f s (the last from %s: %s)\n",
               unlogged_, where_.c_str(), secs, last_from_.c_str(), last_why_.c_str());
  unlogged_ = 0;
  last_line_ = now;
}

void Group::debug_fail_rail(int rail, uint64_t) {
  fail(ErrorKind::Unsupported, "this comm group has no rail ", rail, " to fail");
}

std::unique_ptr<Group> Group::create(const GroupOptions& given) {
  GroupOptions opts = given;
  if (opts.self_name.empty()) opts.self_name = "rank " + std::to_string(opts.rank);
  if (opts.peer_name.empty()) opts.peer_name = "rank " + std::to_string(1 - opts.rank);
  TF_CHECK(opts.size >= 1, "comm group size must be >= 1, got ", opts.size);
  TF_CHECK(opts.rank >= 0 && opts.rank < opts.size, "rank ", opts.rank,
           " out of range for a group of size ", opts.size);
  TF_CHECK(opts.timeout_s > 0, "comm timeout must be > 0 seconds, got ", opts.timeout_s);
  TF_CHECK(opts.transport == "tcp" || opts.transport == "ibverbs",
           "unknown comm transport '", opts.transport, "' (expected 'tcp' or 'ibverbs')");
  TF_CHECK(opts.rails.size() <= 8, "at most 8 rails, got ", opts.rails.size());
  TF_CHECK(opts.small_bytes <= (size_t(64) << 20), "small_bytes must be <= 64 MiB");
  TF_CHECK(opts.chunk_bytes >= 4096 && opts.chunk_bytes <= (size_t(256) << 20),
           "chunk_bytes must be in [4 KiB, 256 MiB], got ", opts.chunk_bytes);
  if (opts.transport == "ibverbs") ibverbs_preflight(opts);  // clear error before connecting
  if (opts.size == 1) return std::make_unique<SoloGroup>();
  if (opts.size > 2)
    fail(ErrorKind::Unsupported, "comm group size ", opts.size,
         " is not supported yet (only 1 and 2, i.e. TP=2)");
  TF_CHECK(!opts.addr.empty(), "comm group of size 2 needs addr='HOST:PORT' (the listening rank's bootstrap address)");

  const Deadline dl = deadline_after(opts.timeout_s);
  const int my_rails = std::max<int>(1, static_cast<int>(opts.rails.size()));
  std::unique_ptr<Bootstrap> boot;
  Agreed agreed;
  if (opts.rank != 0) {
    boot = tcp_bootstrap_connect(opts, dl);
    agreed = handshake(opts, *boot, dl, my_rails);
  } else {
    // Listen until a connection passes the handshake. Each candidate gets a short deadline of
    // its own and a thread of its own, so garbage, silent or half-closed connections cost
    // seconds of a thread, not the group, and never keep the peer waiting behind them; only
    // wait_s (by default none: a worker waits for rank 0) or Ctrl-C ends the wait.
    const Deadline wait_dl = opts.wait_s > 0    ? deadline_after(opts.wait_s)
                             : opts.wait_s == 0 ? deadline_after(1e9)
                                                : dl;
    auto listener = tcp_bootstrap_listen(opts);
    RejectLog log("bootstrap address " + listener->addr(), opts.peer_name);
    std::deque<std::unique_ptr<Candidate>> cands;  // oldest first; destroyed = aborted and joined
    std::unique_ptr<Candidate> winner;
    const auto settle = [&](std::unique_ptr<Candidate> c) {
      if (c->th.joinable()) c->th.join();
      if (c->passed && !winner) {
        winner = std::move(c);
        return;
      }
      if (c->interrupted) check_interrupt();
      log.reject(c->from, c->passed ? "another connection passed the handshake first" : c->error);
    };
    // Once the wait is over, the candidates still in their handshake are unblocked, joined and
    // closed; each is a refused connection all the same.
    const auto close_pending = [&](const std::string& why) {
      while (!cands.empty()) {
        std::unique_ptr<Candidate> c = std::move(cands.front());
        cands.pop_front();
        const bool done = c->finished.load(std::memory_order_acquire);
        c->boot->abort();
        c->th.join();
        log.reject(c->from, !done ? why : c->passed ? "another connection passed the handshake first" : c->error,
                   false);
      }
    };
    while (!winner) {
      for (auto it = cands.begin(); it != cands.end();) {
        if (!(*it)->finished.load(std::memory_order_acquire)) {
          ++it;
          continue;
        }
        std::unique_ptr<Candidate> c = std::move(*it);
        it = cands.erase(it);
        settle(std::move(c));
      }
      if (winner) break;
      check_interrupt();
      log.tick();
      if (Clock::now() >= wait_dl) {
        close_pending("closed: still in its handshake when the wait for " + opts.peer_name + " ended");
        log.finish();
        if (log.count() == 0)
          fail(ErrorKind::Runtime, "peer lost: timed out waiting for ", opts.peer_name,
               " to connect on bootstrap address ", listener->addr());
        fail(ErrorKind::Runtime, "peer lost: timed out waiting for ", opts.peer_name,
             " to connect on bootstrap address ", listener->addr(), "; rejected ", log.count(),
             " connection(s) meanwhile, the last from ", log.last());
      }
      // Short slices: a finished handshake is noticed within one.
      std::unique_ptr<Bootstrap> b = listener->accept(std::min(wait_dl, deadline_after(0.02)));
      if (!b) continue;
      if (cands.size() >= kMaxCandidates) {
        // Make room by dropping the oldest: the one that has had the longest to speak.
        std::unique_ptr<Candidate> oldest = std::move(cands.front());
        cands.pop_front();
        oldest->boot->abort();
        oldest->th.join();
        if (!oldest->passed) {
          oldest->error = "dropped: " + std::to_string(kMaxCandidates) +
                          " connections were in their handshake at once, this one the longest";
          oldest->interrupted = false;
        }
        settle(std::move(oldest));
      }
      const std::string from = b->peer_addr();
      try {
        cands.push_back(start_candidate(opts, std::move(b), my_rails));
      } catch (const std::system_error& e) {  // no thread for it: refuse this connection only
        log.reject(from, std::string("cannot start its handshake: ") + e.what());
      }
    }
    close_pending("closed: still in its handshake when " + opts.peer_name + " was admitted");
    log.finish();
    boot = std::move(winner->boot);
    agreed = winner->agreed;
  }
  const Deadline setup_dl = opts.rank == 0 ? deadline_after(opts.timeout_s) : dl;  // counted from the handshake
  auto tr = opts.transport == "ibverbs" ? ibverbs_transport(opts, agreed.n_rails, *boot, setup_dl)
                                         : tcp_transport(opts, agreed.n_rails, *boot, setup_dl);
  return std::make_unique<PairGroup>(opts, std::move(tr), agreed.small_bytes, agreed.chunk_bytes);
}

}  // namespace tf::comm
