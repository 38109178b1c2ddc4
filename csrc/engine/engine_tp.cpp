// Tensor parallel side of the engine: rank 0 broadcasts each forward's plan (tokens,
// positions, block tables) and a heartbeat; rank 1 validates every plan and mirrors it.
#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <sstream>

#include "core/error.h"
#include "core/interrupt.h"
#include "engine/memory_plan.h"
#include "model/model_config.h"

namespace tf {

namespace {
constexpr int64_t kCmdForward = 1, kCmdShutdown = 2, kCmdPing = 3;
constexpr int kLeaderGroupRank = 1;  // engine rank 0 is group rank 1 (engine rank 1 listens)
}  // namespace

// What both TP ranks must agree on: the same model file and the same engine geometry. Public
// information (anyone with the file can compute it): admission is the token's job. The geometry
// is the one the engine resolves (defaults filled in), so a default on one rank and the same
// value given explicitly on the other agree (v2; v1 carried the options as given). KEY=VALUE
// items: a mismatch names the items that differ (engine.cpp tells the comm layer the option
// behind each key).
std::string Engine::tp_identity(const GgufFile& f, const EngineOptions& o) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the header (metadata + tensor table)
  for (uint64_t i = 0; i < f.data_offset(); ++i) h = (h ^ f.base()[i]) * 1099511628211ull;
  const EngineGeometry g = resolve_geometry(ModelConfig::from_gguf(f), o);
  std::ostringstream os;
  os << "tensorfold-tp-v2 model_bytes=" << f.file_size() << " header_hash=" << std::hex << h << std::dec
     << " tp=" << o.tp.size << " context=" << g.context << " kv_tokens=" << g.kv_tokens
     << " max_batch_tokens=" << g.max_batch_tokens << " max_seqs=" << o.max_seqs << " kv_type=" << (o.kv_type == KvType::F32 ? "f32" : "f16");
  return os.str();
}

Engine::~Engine() {
  if (heartbeat_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(hb_mu_);
      hb_stop_ = true;
    }
    hb_cv_.notify_all();
    heartbeat_.join();
  }
  if (group_ && tp_.rank == 0) {
    try {
      std::lock_guard<std::mutex> lock(comm_mu_);
      send_command(kCmdShutdown, {});
    } catch (...) {
      // the follower is already gone
    }
  }
}

void Engine::send_command(int64_t cmd, const std::vector<int32_t>& payload) {
  int64_t header[4] = {cmd, int64_t(payload.size()), 0, 0};
  group_->broadcast(header, sizeof(header), kLeaderGroupRank);
  if (!payload.empty())
    group_->broadcast(const_cast<int32_t*>(payload.data()), payload.size() * sizeof(int32_t), kLeaderGroupRank);
}

void Engine::heartbeat_loop() {
  // Keeps an idle follower's waits inside its timeout; a lost follower shows up here or in
  // the next forward. Nothing may escape a thread body (std::terminate): every error ends
  // the heartbeat quietly and the next forward reports it.
  try {
    const auto period = std::chrono::duration<double>(std::max(0.05, tp_.timeout_s / 4));
    std::unique_lock<std::mutex> lock(hb_mu_);
    while (!hb_cv_.wait_for(lock, period, [&] { return hb_stop_; })) {
      std::unique_lock<std::mutex> comm(comm_mu_, std::try_to_lock);
      if (!comm.owns_lock()) continue;  // a forward is talking to the follower anyway
      send_command(kCmdPing, {});
    }
  } catch (...) {
  }
}

void Engine::run_forward(const std::vector<BatchToken>& batch, float* logits, float* hidden) {
  if (!group_) {
    model_->forward(batch, *kv_, logits, hidden);
    return;
  }
  std::lock_guard<std::mutex> lock(comm_mu_);
  // Plan: T, then (token, pos, seq, want | exact << 1) per token, then per sequence its slot and its block
  // table in each KV group.
  plan_.clear();
  plan_.push_back(int32_t(batch.size()));
  std::vector<int32_t>& seqs = plan_seqs_;
  seqs.clear();
  for (const BatchToken& b : batch) {
    plan_.insert(plan_.end(), {b.token, b.pos, b.seq, int32_t(b.want_logits) | int32_t(b.exact) << 1});
    if (std::find(seqs.begin(), seqs.end(), b.seq) == seqs.end()) seqs.push_back(b.seq);
  }
  plan_.push_back(int32_t(seqs.size()));
  for (int32_t sq : seqs) {
    plan_.push_back(sq);
    for (int g = 0; g < kv_->n_groups(); ++g) {
      const auto& table = kv_->group(g).block_table(sq);
      plan_.push_back(int32_t(table.size()));
      plan_.insert(plan_.end(), table.begin(), table.end());
    }
  }
  send_command(kCmdForward, plan_);
  model_->forward(batch, *kv_, logits);
}

void Engine::follow() {
  TF_CHECK(tp_.size == 2 && tp_.rank == 1, "follow() is for TP rank 1");
  for (;;) {
    // Idle until rank 0's next command: Ctrl-C is honoured while none of it has arrived, and
    // only then (an interrupted exchange would desynchronise the pair). Rank 0's heartbeat
    // keeps an idle wait inside the timeout. The engine lock is not held while idle.
    int64_t header[4] = {0, 0, 0, 0};
    group_->broadcast_idle(header, sizeof(header), kLeaderGroupRank);
    std::lock_guard<std::mutex> lock(mu_);
    const bool empty = header[1] == 0 && header[2] == 0 && header[3] == 0;
    if (header[0] == kCmdPing && empty) continue;
    if (header[0] == kCmdShutdown && empty) return;
    if (header[0] != kCmdForward || header[2] != 0 || header[3] != 0)
      fail(ErrorKind::InvalidInput, "TP follower: malformed command from rank 0 (", header[0], ", ", header[1], ", ",
           header[2], ", ", header[3], ")");
    if (header[1] < 8 || header[1] > max_plan_ints_)
      fail(ErrorKind::InvalidInput, "TP follower: malformed plan from rank 0: ", header[1],
           " ints (a plan for this engine has 8..", max_plan_ints_, ")");
    plan_.resize(size_t(header[1]));
    group_->broadcast(plan_.data(), plan_.size() * sizeof(int32_t), kLeaderGroupRank);
    apply_plan();
    model_->forward(batch_, *kv_, logits_.data());
    check_weights_intact();  // a shrunk model file ends the follower (rank 0 then sees it gone)
  }
}

void Engine::apply_plan() {
  // Everything here came from the network: check each field before it indexes anything.
  size_t i = 0;
  auto bad = [&](const auto&... what) {
    fail(ErrorKind::InvalidInput, "TP follower: invalid plan from rank 0: ", what...);
  };
  auto next = [&]() {
    if (i >= plan_.size()) bad("truncated (", plan_.size(), " ints)");
    return plan_[i++];
  };
  const int64_t V = config().n_vocab;
  const int max_seqs = kv_->max_seqs();
  const int n_groups = kv_->n_groups();
  // Which group a message is about, when there is more than one.
  auto in_group = [&](int g) { return n_groups > 1 ? " in KV group " + std::to_string(g) : std::string(); };
  const int32_t T = next();
  if (T < 1 || T > max_batch_tokens_) bad(T, " tokens (this engine takes 1..", max_batch_tokens_, " per step)");
  batch_.clear();
  int wants = 0;
  for (int32_t t = 0; t < T; ++t) {
    BatchToken b;
    b.token = next();
    b.pos = next();
    b.seq = next();
    const int32_t want = next();
    if (b.token < 0 || b.token >= V) bad("token ", t, " has id ", b.token, " (vocabulary 0..", V - 1, ")");
    if (b.pos < 0 || b.pos >= context_) bad("token ", t, " has position ", b.pos, " (context 0..", context_ - 1, ")");
    if (b.seq < 0 || b.seq >= max_seqs)
      bad("token ", t, " has sequence slot ", b.seq, " (valid 0..", max_seqs - 1, ")");
    if (want < 0 || want > 3) bad("token ", t, " has flags ", want, " (want_logits | exact << 1: 0..3)");
    b.want_logits = (want & 1) != 0;
    b.exact = (want & 2) != 0;
    wants += want & 1;
    batch_.push_back(b);
  }
  if (wants > kMaxLogitRows) bad(wants, " logits rows (at most ", kMaxLogitRows, " per step)");
  const int32_t n_seq = next();
  if (n_seq < 1 || n_seq > T) bad(n_seq, " sequences for ", T, " tokens");
  // The layout first: where each sequence's table of each group starts (slot_table_at_ holds
  // the first group's; the others follow it, each after its length).
  if (++plan_gen_ == 0) {
    std::fill(slot_mark_.begin(), slot_mark_.end(), 0);
    plan_gen_ = 1;
  }
  std::vector<int32_t>& slots = plan_seqs_;
  slots.clear();
  for (int32_t s = 0; s < n_seq; ++s) {
    const int32_t slot = next();
    if (slot < 0 || slot >= max_seqs) bad("sequence ", s, " has slot ", slot, " (valid 0..", max_seqs - 1, ")");
    if (slot_mark_[size_t(slot)] == plan_gen_) bad("sequence slot ", slot, " is listed twice");
    slot_mark_[size_t(slot)] = plan_gen_;
    slot_table_at_[size_t(slot)] = int64_t(i);
    slots.push_back(slot);
    for (int g = 0; g < n_groups; ++g) {
      const KvPool& pool = kv_->group(g);
      const int64_t max_table = ((context_ + pool.spec().compression - 1) / pool.spec().compression +
                                 pool.block_size() - 1) / pool.block_size();
      const int32_t n = next();
      if (n < 1 || n > max_table)
        bad("sequence slot ", slot, " has a block table of ", n, " blocks", in_group(g), " (1..", max_table, ")");
      if (plan_.size() - i < size_t(n)) bad("truncated block table of sequence slot ", slot);
      i += size_t(n);
    }
  }
  if (i != plan_.size()) bad(plan_.size() - i, " unexpected ints after the block tables");
  // Then each group: a block may be listed by several sequences (a cached prefix they share,
  // read-only), but only once per table; leading blocks may be holes (-1: let go of behind a
  // window); the blocks this plan writes belong to their sequence alone.
  for (int g = 0; g < n_groups; ++g) {
    const KvPool& pool = kv_->group(g);
    if (++block_gen_ == 0) {  // new marks for this group (a generation counter: nothing to clear)
      std::fill(block_mark_.begin(), block_mark_.end(), 0);
      std::fill(block_shared_.begin(), block_shared_.end(), 0);
      block_gen_ = 1;
    }
    for (int32_t slot : slots) {
      size_t at = size_t(slot_table_at_[size_t(slot)]) + 1;
      for (int h = 0; h < g; ++h) at += 1 + size_t(plan_[at - 1]);
      const int32_t n = plan_[at - 1];
      slot_table_len_[size_t(slot)] = n;
      bool lead = true;
      for (int32_t k = 0; k < n; ++k) {
        const int32_t blk = plan_[at + size_t(k)];
        if (blk == -1 && lead && pool.spec().window > 0) continue;
        lead = false;
        if (blk < 0 || blk >= pool.n_blocks())
          bad("sequence slot ", slot, " lists block ", blk, in_group(g), " (valid 0..", pool.n_blocks() - 1, ")");
        if (block_mark_[size_t(blk)] == block_gen_) {
          if (block_slot_[size_t(blk)] == slot) bad("block ", blk, " is used twice in the table of sequence slot ", slot);
          block_shared_[size_t(blk)] = block_gen_;
        }
        block_mark_[size_t(blk)] = block_gen_;
        block_slot_[size_t(blk)] = slot;
      }
    }
    for (size_t t = 0; t < batch_.size(); ++t) {
      const BatchToken& b = batch_[t];
      if (slot_mark_[size_t(b.seq)] != plan_gen_)
        bad("token ", t, " uses sequence slot ", b.seq, " which has no block table");
      size_t at = size_t(slot_table_at_[size_t(b.seq)]) + 1;
      for (int h = 0; h < g; ++h) at += 1 + size_t(plan_[at - 1]);
      const int32_t n = plan_[at - 1];
      const int64_t entry = b.pos / pool.spec().compression, block = entry / pool.block_size();
      if (block >= n) bad("token ", t, " has position ", b.pos, " beyond the ", n, " blocks of sequence slot ", b.seq);
      const int32_t blk = plan_[at + size_t(block)];
      if (blk < 0) bad("token ", t, " of sequence slot ", b.seq, " writes a block let go of");
      if (block_shared_[size_t(blk)] == block_gen_)
        bad("block ", blk, " is used twice: token ", t, " of sequence slot ", b.seq,
            " writes it while another sequence's table lists it");
    }
  }
  // Valid: mirror the tables.
  for (int32_t slot : slots) {
    size_t at = size_t(slot_table_at_[size_t(slot)]) + 1;
    for (int g = 0; g < n_groups; ++g) {
      const int32_t n = plan_[at - 1];
      kv_->assign_tables(slot, g, plan_.data() + at, size_t(n));
      at += size_t(n) + 1;
    }
  }
}

comm::GroupStats Engine::comm_stats() const {
  return group_ ? group_->stats() : comm::GroupStats{};
}

void Engine::load_with_heartbeat(TpShard shard) {
  // Two ranks rarely finish loading together (100 GB from different disks), and a collective
  // waits only timeout_s for its peer. So while this rank reads its slices, a thread exchanges
  // a tiny All-Reduce with the peer about twice a second: "I am alive, loaded or not". It ends
  // when both report loaded — the barrier — or fails when the peer goes silent for timeout_s
  // (a lost peer) or the pair has not loaded within load_timeout_s.
  std::atomic<bool> loaded{false}, failed{false}, hb_done{false};
  std::exception_ptr hb_error;
  const auto t0 = std::chrono::steady_clock::now();
  std::thread hb([&] {
    try {
      for (;;) {
        float state = failed ? -1.f : loaded ? 1.f : 0.f;
        group_->all_reduce(&state, 1, comm::DType::F32);
        if (state < 0 || failed)  // either side failed to load: stop (that side reports why)
          fail(ErrorKind::Runtime, "the TP peer stopped while loading the model (it failed or was "
               "interrupted; its own output says why)");
        if (state >= 2.f) break;  // both loaded
        const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (waited > tp_.load_timeout_s)
          fail(ErrorKind::Runtime, "the TP pair has not finished loading within ", tp_.load_timeout_s,
               " s (load_timeout); this rank ", loaded ? "has" : "has not", " loaded");
        std::this_thread::sleep_for(std::chrono::milliseconds(500));
      }
    } catch (...) {
      hb_error = std::current_exception();
      load_abandoned_ = true;
    }
    hb_done = true;
  });
  shard.abandon = &load_abandoned_;
  try {
    if (const char* d = std::getenv("TENSORFOLD_TEST_LOAD_DELAY_S")) {  // tests: a slow disk (Ctrl-C ends it)
      const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(std::atof(d));
      while (std::chrono::steady_clock::now() < until && !load_abandoned_) {
        check_interrupt();
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
    model_ = std::make_unique<Model>(file_, be_.get(), shard);
    loaded = true;
    // The barrier: wait for the peer's "loaded" (however long, up to load_timeout) but not
    // past a Ctrl-C.
    while (!hb_done) {
      check_interrupt();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  } catch (...) {
    failed = true;  // the heartbeat tells the peer at its next exchange, or the closed link does
    hb.join();
    if (hb_error && !interrupt_requested()) std::rethrow_exception(hb_error);  // why the load stopped
    throw;
  }
  hb.join();
  if (hb_error) std::rethrow_exception(hb_error);
}

}  // namespace tf
