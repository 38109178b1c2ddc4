#include "engine/engine.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <sstream>
#include <thread>

#include "core/cpu_features.h"
#include "core/error.h"

namespace tf {

namespace {
constexpr int64_t kCmdForward = 1, kCmdShutdown = 2, kCmdPing = 3;
constexpr int kLeaderGroupRank = 1;  // engine rank 0 is group rank 1 (engine rank 1 listens)

std::string gib(double bytes) {
  std::ostringstream os;
  const double g = bytes / double(1ull << 30);
  os << std::fixed << std::setprecision(g < 10 ? 2 : 1) << g << " GiB";
  return os.str();
}

// Memory this process can have at most: physical RAM, lowered to a cgroup memory limit.
uint64_t memory_limit_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  uint64_t m = pages > 0 && page > 0 ? uint64_t(pages) * uint64_t(page) : 0;
  for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream f(path);
    std::string v;
    if (!(f >> v) || v == "max") continue;
    char* end = nullptr;
    const unsigned long long c = std::strtoull(v.c_str(), &end, 10);
    if (end && *end == '\0' && c > 0 && (m == 0 || c < m)) m = c;
  }
  return m;
}
}  // namespace

// What both TP ranks must agree on: the same model file and the same engine geometry. Public
// information (anyone with the file can compute it): admission is the token's job.
std::string Engine::tp_identity(const GgufFile& f, const EngineOptions& o) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the header (metadata + tensor table)
  for (uint64_t i = 0; i < f.data_offset(); ++i) h = (h ^ f.base()[i]) * 1099511628211ull;
  std::ostringstream os;
  os << "tensorfold-tp-v1 model_bytes=" << f.file_size() << " header_hash=" << std::hex << h << std::dec
     << " tp=" << o.tp.size << " context=" << o.context << " kv_tokens=" << o.kv_tokens
     << " max_batch_tokens=" << o.max_batch_tokens << " kv_type=" << int(o.kv_type);
  return os.str();
}

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::Stop: return "stop";
    case FinishReason::Length: return "length";
    case FinishReason::Abort: return "abort";
    default: return "";
  }
}

void Engine::check_sizes(const EngineOptions& opts, int64_t n_blocks) const {
  // Sizes that cannot work on this machine at all (or overflow), named one by one, before
  // the plan is weighed against the budget.
  const ModelConfig& c = model_->config();
  const KvLayout layout = model_->kv_layout();
  const uint64_t per_token = PagedKvCache::bytes_per_token(c.n_layer, layout, opts.kv_type);
  const int elem = opts.kv_type == KvType::F32 ? 4 : 2;
  std::ostringstream why;
  why << "(kv_tokens " << n_blocks * kKvBlockSize << " x " << c.n_layer << " layers x " << layout.n_heads
      << " KV heads x ";
  if (layout.v_dim == layout.k_dim)
    why << "head dim " << layout.k_dim << " x K and V";
  else
    why << "(K " << layout.k_dim << " + V " << layout.v_dim << ") values";
  why << " x " << elem << " bytes)";
  const double want_exact = double(c.n_layer) * double(layout.values_per_position()) * elem * double(n_blocks) *
                            kKvBlockSize;
  uint64_t pool_bytes = 0;
  if (per_token == 0 || __builtin_mul_overflow(per_token, uint64_t(n_blocks) * kKvBlockSize, &pool_bytes))
    fail(ErrorKind::OutOfMemory, "the KV cache would need ", gib(want_exact), " ", why.str(),
         ", more than can be addressed; lower kv_tokens or context");
  const uint64_t limit = memory_limit_bytes();
  if (limit > 0 && pool_bytes > limit)
    fail(ErrorKind::OutOfMemory, "the KV cache would need ", gib(double(pool_bytes)), " ", why.str(),
         " but this machine has ", gib(double(limit)), " of memory; lower kv_tokens or context",
         opts.kv_type == KvType::F32 ? " (or use kv_type f16)" : "");
  uint64_t logits_bytes = 0;
  if (c.n_vocab <= 0 ||
      __builtin_mul_overflow(uint64_t(kMaxLogitRows) * sizeof(float), uint64_t(c.n_vocab), &logits_bytes) ||
      (limit > 0 && logits_bytes > limit))
    fail(ErrorKind::OutOfMemory, "the logits buffer (", kMaxLogitRows, " rows x vocabulary ", c.n_vocab,
         ") does not fit in memory");
  const double scratch = model_->scratch_bytes(max_batch_tokens_);
  if (limit > 0 && double(pool_bytes) + scratch > double(limit))
    fail(ErrorKind::OutOfMemory, "activation scratch for ", max_batch_tokens_, " tokens per step (",
         gib(scratch), ") and the KV cache (", gib(double(pool_bytes)), ") exceed this machine's ",
         gib(double(limit)), " of memory; lower max_batch_tokens, kv_tokens or context");
}

Engine::Engine(const std::string& model_path, const EngineOptions& opts) {
  // Options that need no model are checked before anything is opened or allocated.
  TF_CHECK(opts.threads >= 0 && opts.threads <= 1024, "threads = ", opts.threads,
           " is out of range (1..1024, or 0 for the usable CPUs)");
  TF_CHECK(opts.max_batch_tokens >= 1, "max_batch_tokens must be >= 1, got ", opts.max_batch_tokens);
  TF_CHECK(opts.context >= 0 && opts.context <= kMaxContext, "context = ", opts.context,
           " is out of range (2..", kMaxContext, ", or 0 for the model's)");
  TF_CHECK(opts.kv_tokens >= 0, "kv_tokens must be >= 0 (0: automatic), got ", opts.kv_tokens);
  if (opts.kv_tokens > kMaxKvTokens)
    fail(ErrorKind::InvalidInput, "kv_tokens = ", opts.kv_tokens, " is above the limit of ", kMaxKvTokens,
         " tokens; lower kv_tokens");
  file_ = GgufFile::open(model_path);
  tp_ = opts.tp;
  TF_CHECK(tp_.size == 1 || tp_.size == 2, "tensor parallel size must be 1 or 2, got ", tp_.size);
  TF_CHECK(tp_.rank >= 0 && tp_.rank < tp_.size, "TP rank ", tp_.rank, " is out of range for size ", tp_.size);
  TpShard shard;
  shard.tp_compatible = tp_.compatible;
  // The model's geometry and this rank's bytes first, from views of the file (TP=2: the slice
  // sizes, nothing read, no peer needed): the whole memory plan is checked before any large
  // allocation, before a TP pair even connects. At TP=1 this model is the one that runs.
  TpShard planning = shard;
  planning.size = tp_.size;
  planning.rank = tp_.rank;
  planning.plan_only = tp_.size > 1;
  model_ = std::make_unique<LlamaModel>(file_, planning);
  const ModelConfig c = model_->config();  // a copy: at TP=2 the planning model is replaced below
  const int threads = opts.threads > 0 ? opts.threads : usable_cpus();
  const EngineGeometry geometry = resolve_geometry(c, opts);
  context_ = geometry.context;
  max_batch_tokens_ = geometry.max_batch_tokens;
  const int64_t n_blocks = geometry.kv_tokens / kKvBlockSize;
  check_sizes(opts, n_blocks);
  memory_plan_ = plan_memory(*model_, geometry, opts);
  if (!memory_plan_.fits())
    fail(ErrorKind::OutOfMemory, "the memory plan of this engine exceeds its budget (", memory_plan_.budget_source,
         "); lower kv_tokens, context or max_batch_tokens, or raise memory_budget:\n", memory_plan_.table());
  if (tp_.size == 2) {
    TF_CHECK(!tp_.addr.empty(), "TP=2 needs the peer address (HOST:PORT)");
    comm::GroupOptions g;
    g.rank = (tp_.rank + 1) % 2;
    g.size = 2;
    g.addr = tp_.addr;
    g.rails = tp_.rails;
    g.timeout_s = tp_.timeout_s;
    g.wait_s = tp_.wait_s;
    g.transport = tp_.transport;
    g.handshake = tp_identity(*file_, opts);
    g.token = tp_.token;
    group_ = comm::Group::create(g);
    shard.rank = tp_.rank;
    shard.size = 2;
    shard.group = group_.get();
    shard.group_rank_offset = 1;
  }
  if (tp_.size == 2) load_with_heartbeat(shard);  // reads this rank's slices
  else file_->prefault();  // the mapped weights resident now, as planned, not page by page while serving
  kv_ = std::make_unique<PagedKvCache>(c.n_layer, model_->kv_layout(), kKvBlockSize, n_blocks, opts.kv_type);
  kv_->prefault();
  pool_ = std::make_unique<ThreadPool>(threads);
  // Ctrl-C may stop a local forward (TP=1) or the follower (which then exits), but never
  // rank 0 of a TP pair mid-collective: that would desynchronise the pair.
  pool_->set_interruptible(!(tp_.size == 2 && tp_.rank == 0));
  model_->reserve(max_batch_tokens_, context_, threads);
  logits_.assign(size_t(kMaxLogitRows) * size_t(c.n_vocab), 0.f);
  batch_.reserve(size_t(max_batch_tokens_));
  batch_owner_.reserve(size_t(max_batch_tokens_));
  if (tp_.size == 2 && tp_.rank == 1) {
    // Largest plan rank 0 can send: T, 4 ints per token, n_seq, 2 ints per sequence and the
    // block tables (distinct blocks, so at most the pool, and at most context/16 per sequence).
    const int64_t M = max_batch_tokens_;
    const int64_t max_table = (context_ + kKvBlockSize - 1) / kKvBlockSize;
    max_plan_ints_ = 2 + 6 * M + std::min<int64_t>(M * max_table, n_blocks);
    slot_mark_.assign(size_t(kv_->max_seqs()), 0);
    slot_table_len_.assign(size_t(kv_->max_seqs()), 0);
    block_mark_.assign(size_t(n_blocks), 0);
  }
  if (tp_.size == 2 && tp_.rank == 0) heartbeat_ = std::thread(&Engine::heartbeat_loop, this);
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

void Engine::require_leader(const char* what) const {
  if (tp_.rank != 0)
    fail(ErrorKind::InvalidInput, what, ": this engine is TP rank ", tp_.rank,
         ", which only follows rank 0; send requests to rank 0");
}

void Engine::send_command(int64_t cmd, const std::vector<int32_t>& payload) {
  int64_t header[4] = {cmd, int64_t(payload.size()), 0, 0};
  group_->broadcast(header, sizeof(header), kLeaderGroupRank);
  if (!payload.empty())
    group_->broadcast(const_cast<int32_t*>(payload.data()), payload.size() * sizeof(int32_t), kLeaderGroupRank);
}

void Engine::load_with_heartbeat(const TpShard& shard) {
  // Two ranks rarely finish loading together (100 GB from different disks), and a collective
  // waits only timeout_s for its peer. So while this rank reads its slices, a thread exchanges
  // a tiny All-Reduce with the peer about twice a second: "I am alive, loaded or not". It ends
  // when both report loaded — the barrier — or fails when the peer goes silent for timeout_s
  // (a lost peer) or the pair has not loaded within load_timeout_s.
  std::atomic<bool> loaded{false}, failed{false};
  std::exception_ptr hb_error;
  const auto t0 = std::chrono::steady_clock::now();
  std::thread hb([&] {
    try {
      for (;;) {
        float state = failed ? -1.f : loaded ? 1.f : 0.f;
        group_->all_reduce(&state, 1, comm::DType::F32);
        if (state < 0 || failed)  // either side failed to load: stop (that side reports why)
          fail(ErrorKind::Runtime, "the TP peer failed while loading the model");
        if (state >= 2.f) return;  // both loaded
        const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (waited > tp_.load_timeout_s)
          fail(ErrorKind::Runtime, "the TP pair has not finished loading within ", tp_.load_timeout_s,
               " s (load_timeout); this rank ", loaded ? "has" : "has not", " loaded");
        std::this_thread::sleep_for(std::chrono::milliseconds(500));
      }
    } catch (...) {
      hb_error = std::current_exception();
    }
  });
  try {
    if (const char* d = std::getenv("TENSORFOLD_TEST_LOAD_DELAY_S"))  // tests: a slow disk
      std::this_thread::sleep_for(std::chrono::duration<double>(std::atof(d)));
    model_ = std::make_unique<LlamaModel>(file_, shard);
  } catch (...) {
    failed = true;
    hb.join();
    throw;
  }
  loaded = true;
  hb.join();
  if (hb_error) std::rethrow_exception(hb_error);
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

void Engine::run_forward(const std::vector<BatchToken>& batch, float* logits) {
  if (!group_) {
    model_->forward(batch, *kv_, *pool_, logits);
    return;
  }
  std::lock_guard<std::mutex> lock(comm_mu_);
  // Plan: T, then (token, pos, seq, want) per token, then the block table of each sequence.
  plan_.clear();
  plan_.push_back(int32_t(batch.size()));
  std::vector<int32_t>& seqs = plan_seqs_;
  seqs.clear();
  for (const BatchToken& b : batch) {
    plan_.insert(plan_.end(), {b.token, b.pos, b.seq, int32_t(b.want_logits)});
    if (std::find(seqs.begin(), seqs.end(), b.seq) == seqs.end()) seqs.push_back(b.seq);
  }
  plan_.push_back(int32_t(seqs.size()));
  for (int32_t sq : seqs) {
    const auto& table = kv_->block_table(sq);
    plan_.push_back(sq);
    plan_.push_back(int32_t(table.size()));
    plan_.insert(plan_.end(), table.begin(), table.end());
  }
  send_command(kCmdForward, plan_);
  model_->forward(batch, *kv_, *pool_, logits);
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
    model_->forward(batch_, *kv_, *pool_, logits_.data());
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
    if (want != 0 && want != 1) bad("token ", t, " has want_logits ", want, " (0 or 1)");
    b.want_logits = want != 0;
    wants += want;
    batch_.push_back(b);
  }
  if (wants > kMaxLogitRows) bad(wants, " logits rows (at most ", kMaxLogitRows, " per step)");
  const int32_t n_seq = next();
  if (n_seq < 1 || n_seq > T) bad(n_seq, " sequences for ", T, " tokens");
  // New marks for this plan (a generation counter, so nothing needs clearing).
  if (++plan_gen_ == 0) {
    std::fill(slot_mark_.begin(), slot_mark_.end(), 0);
    std::fill(block_mark_.begin(), block_mark_.end(), 0);
    plan_gen_ = 1;
  }
  const int64_t max_table = (context_ + kKvBlockSize - 1) / kKvBlockSize;
  const size_t tables_begin = i;
  for (int32_t s = 0; s < n_seq; ++s) {
    const int32_t slot = next();
    const int32_t n = next();
    if (slot < 0 || slot >= max_seqs) bad("sequence ", s, " has slot ", slot, " (valid 0..", max_seqs - 1, ")");
    if (slot_mark_[size_t(slot)] == plan_gen_) bad("sequence slot ", slot, " is listed twice");
    slot_mark_[size_t(slot)] = plan_gen_;
    if (n < 1 || n > max_table) bad("sequence slot ", slot, " has a block table of ", n, " blocks (1..", max_table, ")");
    if (plan_.size() - i < size_t(n)) bad("truncated block table of sequence slot ", slot);
    slot_table_len_[size_t(slot)] = n;
    for (int32_t k = 0; k < n; ++k) {
      const int32_t blk = plan_[i + size_t(k)];
      if (blk < 0 || blk >= kv_->n_blocks())
        bad("sequence slot ", slot, " lists block ", blk, " (valid 0..", kv_->n_blocks() - 1, ")");
      if (block_mark_[size_t(blk)] == plan_gen_) bad("block ", blk, " is used twice");
      block_mark_[size_t(blk)] = plan_gen_;
    }
    i += size_t(n);
  }
  if (i != plan_.size()) bad(plan_.size() - i, " unexpected ints after the block tables");
  for (size_t t = 0; t < batch_.size(); ++t) {
    const BatchToken& b = batch_[t];
    if (slot_mark_[size_t(b.seq)] != plan_gen_) bad("token ", t, " uses sequence slot ", b.seq, " which has no block table");
    if (int64_t(b.pos) >= int64_t(slot_table_len_[size_t(b.seq)]) * kKvBlockSize)
      bad("token ", t, " has position ", b.pos, " beyond the ", slot_table_len_[size_t(b.seq)],
          " blocks of sequence slot ", b.seq);
  }
  // Valid: mirror the tables.
  for (size_t j = tables_begin; j < i;) {
    const int32_t slot = plan_[j], n = plan_[j + 1];
    kv_->assign_table(slot, plan_.data() + j + 2, size_t(n));
    j += 2 + size_t(n);
  }
}

comm::GroupStats Engine::comm_stats() const {
  return group_ ? group_->stats() : comm::GroupStats{};
}

int64_t Engine::free_kv_tokens() const {
  std::lock_guard<std::mutex> lock(mu_);
  return kv_->free_blocks() * kv_->block_size();
}

EngineStats Engine::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

std::vector<std::vector<int64_t>> Engine::expert_usage() const {
  std::lock_guard<std::mutex> lock(mu_);  // the model updates it during forward
  return model_->expert_usage();
}

bool Engine::has_unfinished() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !seqs_.empty();
}

size_t Engine::n_active() const {
  std::lock_guard<std::mutex> lock(mu_);
  return seqs_.size();
}

int64_t Engine::add_request(const std::vector<int32_t>& prompt, const RequestParams& params) {
  require_leader("add_request");
  TF_CHECK(!prompt.empty(), "the prompt is empty: give at least one token");
  for (int32_t t : prompt)
    TF_CHECK(t >= 0 && t < config().n_vocab, "prompt token id ", t, " is outside the vocabulary (0..",
             config().n_vocab - 1, ")");
  TF_CHECK(int64_t(prompt.size()) < context_, "the prompt has ", prompt.size(),
           " tokens but the context is ", context_, "; shorten it or raise context");
  TF_CHECK(params.max_tokens >= 0, "max_tokens must be >= 0, got ", params.max_tokens);
  // NaN passes no comparison, so each check is written to fail for it.
  const SamplingParams& sp = params.sampling;
  TF_CHECK(std::isfinite(sp.temperature) && sp.temperature >= 0.f,
           "temperature must be a finite number >= 0 (0 = greedy), got ", sp.temperature);
  TF_CHECK(sp.top_p > 0.f && sp.top_p <= 1.f, "top_p must be in (0, 1] (1 = off), got ", sp.top_p);
  TF_CHECK(sp.min_p >= 0.f && sp.min_p <= 1.f, "min_p must be in [0, 1] (0 = off), got ", sp.min_p);
  TF_CHECK(sp.top_k >= 0, "top_k must be >= 0 (0 = off), got ", sp.top_k);
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t id = next_id_++;
  seqs_.emplace(id, std::make_unique<Sequence>(id, prompt, params));
  return id;
}

void Engine::abort(int64_t request_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = seqs_.find(request_id);
  if (it == seqs_.end()) return;
  if (it->second->slot >= 0) kv_->free_sequence(it->second->slot);
  seqs_.erase(it);
}

void Engine::finish(Sequence& s, FinishReason reason, std::vector<StepOutput>& out, int32_t token) {
  out.push_back({s.id, token, true, reason});
  if (s.slot >= 0) kv_->free_sequence(s.slot);
  s.slot = -1;
}

void Engine::preempt(Sequence& s) {
  // Recompute later: drop its cache; its generated tokens become part of what is re-read.
  if (s.slot >= 0) kv_->free_sequence(s.slot);
  s.slot = -1;
  s.n_computed = 0;
  ++stats_.preemptions;
}

std::vector<StepOutput> Engine::step() {
  require_leader("step");
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<StepOutput> out;
  batch_.clear();
  batch_owner_.clear();
  int budget = max_batch_tokens_;
  int logit_rows = 0;

  // max_tokens == 0: finish at once without computing anything.
  for (auto it = seqs_.begin(); it != seqs_.end();) {
    if (it->second->params.max_tokens == 0) {
      finish(*it->second, FinishReason::Length, out, -1);
      it = seqs_.erase(it);
    } else {
      ++it;
    }
  }

  // 1. Decode: running sequences with exactly one token to compute.
  for (auto& [id, sp] : seqs_) {
    Sequence& s = *sp;
    if (s.slot < 0 || s.tokens.size() - s.n_computed != 1) continue;
    if (budget == 0 || logit_rows == kMaxLogitRows) break;
    while (!kv_->reserve(s.slot, int64_t(s.n_computed) + 1)) {
      // Pool exhausted: preempt the newest other sequence holding blocks.
      Sequence* victim = nullptr;
      for (auto rit = seqs_.rbegin(); rit != seqs_.rend(); ++rit)
        if (rit->second.get() != &s && rit->second->slot >= 0) { victim = rit->second.get(); break; }
      if (!victim) break;
      // Never preempt a sequence already placed in this batch.
      if (std::find(batch_owner_.begin(), batch_owner_.end(), victim) != batch_owner_.end()) break;
      preempt(*victim);
    }
    if (kv_->capacity(s.slot) < int64_t(s.n_computed) + 1) continue;  // waits for a later step
    batch_.push_back({s.tokens.back(), int32_t(s.n_computed), int32_t(s.slot), true});
    batch_owner_.push_back(&s);
    --budget;
    ++logit_rows;
  }
  const size_t n_decode = batch_.size();

  // 2. Prefill (chunked): everything else, oldest first, within the remaining budget.
  for (auto& [id, sp] : seqs_) {
    Sequence& s = *sp;
    if (budget == 0 || logit_rows == kMaxLogitRows) break;
    if (s.slot >= 0 && s.tokens.size() - s.n_computed == 1) continue;  // decode, handled above
    if (std::find(batch_owner_.begin(), batch_owner_.end(), &s) != batch_owner_.end()) continue;
    const size_t pending = s.tokens.size() - s.n_computed;
    const size_t chunk = std::min<size_t>(pending, size_t(budget));
    const bool new_slot = s.slot < 0;
    if (new_slot) s.slot = kv_->create_sequence();
    if (s.slot < 0) break;  // every sequence slot is taken: wait for one to finish
    if (!kv_->reserve(s.slot, int64_t(s.n_computed + chunk))) {
      if (new_slot) {
        kv_->free_sequence(s.slot);
        s.slot = -1;
      }
      break;  // keep arrival order: later requests wait too
    }
    for (size_t i = 0; i < chunk; ++i) {
      const size_t pos = s.n_computed + i;
      const bool last = pos + 1 == s.tokens.size();
      batch_.push_back({s.tokens[pos], int32_t(pos), int32_t(s.slot), last});
      batch_owner_.push_back(&s);
      if (last) ++logit_rows;
    }
    budget -= int(chunk);
  }
  if (batch_.empty()) return out;

  const auto t0 = std::chrono::steady_clock::now();
  run_forward(batch_, logits_.data());
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ++stats_.steps;
  const size_t n_prefill = batch_.size() - n_decode;
  if (n_prefill > 0) {
    stats_.prefill_seconds += dt;
    stats_.prompt_tokens += int64_t(n_prefill);
  } else {
    stats_.decode_seconds += dt;
  }

  // 3. Advance, sample and check stop conditions.
  const int64_t V = config().n_vocab;
  int row = 0;
  std::vector<int64_t>& done = done_;
  done.clear();
  for (size_t i = 0; i < batch_.size(); ++i) {
    Sequence& s = *batch_owner_[i];
    s.n_computed = size_t(batch_[i].pos) + 1;
    if (!batch_[i].want_logits) continue;
    const int32_t tok = s.sampler.sample(logits_.data() + size_t(row++) * size_t(V), V);
    s.tokens.push_back(tok);
    ++s.n_generated;
    ++stats_.generated_tokens;
    const auto& eog = s.params.eog_ids;
    FinishReason reason = FinishReason::None;
    if (!s.params.ignore_eos && std::find(eog.begin(), eog.end(), tok) != eog.end())
      reason = FinishReason::Stop;
    else if (s.n_generated >= s.params.max_tokens || int64_t(s.tokens.size()) >= context_)
      reason = FinishReason::Length;
    if (reason != FinishReason::None) {
      finish(s, reason, out, tok);
      done.push_back(s.id);
    } else {
      out.push_back({s.id, tok, false, FinishReason::None});
    }
  }
  for (int64_t id : done) seqs_.erase(id);
  return out;
}

void Engine::logits(const std::vector<int32_t>& ids, float* out) {
  require_leader("logits");
  TF_CHECK(!ids.empty(), "logits: empty token list");
  TF_CHECK(int64_t(ids.size()) <= context_, "logits: ", ids.size(), " tokens exceed the context ", context_);
  for (int32_t t : ids)
    TF_CHECK(t >= 0 && t < config().n_vocab, "token id ", t, " is outside the vocabulary (0..",
             config().n_vocab - 1, ")");
  std::lock_guard<std::mutex> lock(mu_);
  logits_locked(ids, out);
}

void Engine::logits_locked(const std::vector<int32_t>& ids, float* out) {
  const size_t V = size_t(config().n_vocab);
  const int slot = kv_->create_sequence();
  if (slot < 0)
    fail(ErrorKind::OutOfMemory, "logits: every KV sequence slot is in use by running requests");
  if (!kv_->reserve(slot, int64_t(ids.size()))) {
    kv_->free_sequence(slot);
    fail(ErrorKind::OutOfMemory, "logits: not enough free KV cache for ", ids.size(),
         " tokens while other requests are running");
  }
  std::vector<BatchToken> batch;
  const size_t chunk = size_t(std::min(max_batch_tokens_, kMaxLogitRows));
  try {
    for (size_t b = 0; b < ids.size(); b += chunk) {
      batch.clear();
      for (size_t i = b; i < std::min(ids.size(), b + chunk); ++i)
        batch.push_back({ids[i], int32_t(i), int32_t(slot), true});
      // Rows go straight to the caller's array (no second copy of the result).
      run_forward(batch, out ? out + b * V : logits_.data());
    }
  } catch (...) {
    kv_->free_sequence(slot);
    throw;
  }
  kv_->free_sequence(slot);
}

std::vector<std::vector<int32_t>> Engine::routing(const std::vector<int32_t>& ids) {
  require_leader("routing");
  TF_CHECK(!ids.empty(), "routing: empty token list");
  TF_CHECK(int64_t(ids.size()) <= context_, "routing: ", ids.size(), " tokens exceed the context ", context_);
  for (int32_t t : ids)
    TF_CHECK(t >= 0 && t < config().n_vocab, "token id ", t, " is outside the vocabulary (0..",
             config().n_vocab - 1, ")");
  std::lock_guard<std::mutex> lock(mu_);
  model_->set_routing_trace(true);
  try {
    logits_locked(ids, nullptr);
  } catch (...) {
    model_->set_routing_trace(false);
    throw;
  }
  std::vector<std::vector<int32_t>> trace = model_->routing_trace();
  model_->set_routing_trace(false);
  return trace;
}

}  // namespace tf
