#include "engine/engine.h"

#include <algorithm>
#include <sstream>
#include <chrono>
#include <thread>

#include "core/error.h"

namespace tf {

namespace {
constexpr int64_t kCmdForward = 1, kCmdShutdown = 2, kCmdPing = 3;
constexpr int kLeaderGroupRank = 1;  // engine rank 0 is group rank 1 (engine rank 1 listens)

// What both TP ranks must agree on: the same model file and the same engine geometry.
std::string tp_identity(const GgufFile& f, const EngineOptions& o) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the header (metadata + tensor table)
  for (uint64_t i = 0; i < f.data_offset(); ++i) h = (h ^ f.base()[i]) * 1099511628211ull;
  std::ostringstream os;
  os << "tensorfold-tp-v1 model_bytes=" << f.file_size() << " header_hash=" << std::hex << h << std::dec
     << " tp=" << o.tp.size << " context=" << o.context << " kv_tokens=" << o.kv_tokens
     << " max_batch_tokens=" << o.max_batch_tokens << " kv_type=" << int(o.kv_type);
  return os.str();
}
constexpr int kKvBlockSize = 16;
constexpr int kMaxLogitRows = 64;  // logits rows one step may produce (= max sequences per step)
}  // namespace

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::Stop: return "stop";
    case FinishReason::Length: return "length";
    case FinishReason::Abort: return "abort";
    default: return "";
  }
}

Engine::Engine(const std::string& model_path, const EngineOptions& opts) {
  file_ = GgufFile::open(model_path);
  tp_ = opts.tp;
  TF_CHECK(tp_.size == 1 || tp_.size == 2, "tensor parallel size must be 1 or 2, got ", tp_.size);
  TF_CHECK(tp_.rank >= 0 && tp_.rank < tp_.size, "TP rank ", tp_.rank, " is out of range for size ", tp_.size);
  TpShard shard;
  shard.tp_compatible = tp_.compatible;
  if (tp_.size == 2) {
    TF_CHECK(!tp_.addr.empty(), "TP=2 needs the peer address (HOST:PORT)");
    comm::GroupOptions g;
    g.rank = (tp_.rank + 1) % 2;
    g.size = 2;
    g.addr = tp_.addr;
    g.rails = tp_.rails;
    g.timeout_s = tp_.timeout_s;
    g.handshake = tp_identity(*file_, opts);
    group_ = comm::Group::create(g);
    shard.rank = tp_.rank;
    shard.size = 2;
    shard.group = group_.get();
    shard.group_rank_offset = 1;
  }
  model_ = std::make_unique<LlamaModel>(file_, shard);
  const ModelConfig& c = model_->config();
  int threads = opts.threads;
  if (threads <= 0) threads = int(std::max(1u, std::thread::hardware_concurrency()));
  TF_CHECK(threads <= 1024, "threads = ", threads, " is not sensible");
  context_ = opts.context > 0 ? opts.context : std::min<int64_t>(c.n_ctx_train > 0 ? c.n_ctx_train : 4096, 8192);
  TF_CHECK(context_ >= 2 && context_ <= (int64_t(1) << 24), "context = ", context_, " is out of range");
  int64_t kv_tokens = opts.kv_tokens > 0 ? opts.kv_tokens : std::max<int64_t>(context_, 4096);
  if (kv_tokens < context_)
    fail(ErrorKind::InvalidInput, "kv_tokens (", kv_tokens, ") must be at least the context (", context_,
         ") so that one full-length sequence fits; raise kv_tokens or lower context");
  max_batch_tokens_ = std::max(1, opts.max_batch_tokens);
  const int64_t n_blocks = (kv_tokens + kKvBlockSize - 1) / kKvBlockSize;
  kv_ = std::make_unique<PagedKvCache>(c.n_layer, model_->local_kv_heads(), c.head_dim, kKvBlockSize, n_blocks,
                                       opts.kv_type);
  pool_ = std::make_unique<ThreadPool>(threads);
  model_->reserve(max_batch_tokens_, context_, threads);
  logits_.assign(size_t(kMaxLogitRows) * size_t(c.n_vocab), 0.f);
  batch_.reserve(size_t(max_batch_tokens_));
  batch_owner_.reserve(size_t(max_batch_tokens_));
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

void Engine::heartbeat_loop() {
  // Keeps an idle follower's waits inside its timeout; a lost follower shows up here or in
  // the next forward.
  const auto period = std::chrono::duration<double>(std::max(0.05, tp_.timeout_s / 4));
  std::unique_lock<std::mutex> lock(hb_mu_);
  while (!hb_cv_.wait_for(lock, period, [&] { return hb_stop_; })) {
    std::unique_lock<std::mutex> comm(comm_mu_, std::try_to_lock);
    if (!comm.owns_lock()) continue;  // a forward is talking to the follower anyway
    try {
      send_command(kCmdPing, {});
    } catch (...) {
      return;  // reported by the next forward
    }
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
    int64_t header[4] = {0, 0, 0, 0};
    group_->broadcast(header, sizeof(header), kLeaderGroupRank);
    if (header[0] == kCmdPing) continue;
    if (header[0] == kCmdShutdown) return;
    TF_CHECK(header[0] == kCmdForward && header[1] > 0 && header[1] < (int64_t(1) << 26),
             "TP follower: malformed plan from rank 0");
    plan_.resize(size_t(header[1]));
    group_->broadcast(plan_.data(), plan_.size() * sizeof(int32_t), kLeaderGroupRank);
    size_t i = 0;
    auto next = [&]() {
      TF_CHECK(i < plan_.size(), "TP follower: truncated plan");
      return plan_[i++];
    };
    const int32_t T = next();
    TF_CHECK(T > 0 && T <= max_batch_tokens_, "TP follower: plan of ", T, " tokens");
    batch_.clear();
    for (int32_t t = 0; t < T; ++t) {
      BatchToken b;
      b.token = next();
      b.pos = next();
      b.seq = next();
      b.want_logits = next() != 0;
      batch_.push_back(b);
    }
    const int32_t n_seq = next();
    for (int32_t s = 0; s < n_seq; ++s) {
      const int32_t slot = next();
      const int32_t n = next();
      TF_CHECK(n >= 0 && i + size_t(n) <= plan_.size(), "TP follower: truncated block table");
      kv_->assign_table(slot, plan_.data() + i, size_t(n));
      i += size_t(n);
    }
    for (const BatchToken& b : batch_)
      TF_CHECK(b.pos >= 0 && int64_t(b.pos) < kv_->capacity(b.seq), "TP follower: position outside the pages");
    model_->forward(batch_, *kv_, *pool_, logits_.data());
  }
}

comm::GroupStats Engine::comm_stats() const {
  return group_ ? group_->stats() : comm::GroupStats{};
}

int64_t Engine::add_request(const std::vector<int32_t>& prompt, const RequestParams& params) {
  require_leader("add_request");
  TF_CHECK(!prompt.empty(), "the prompt is empty: give at least one token");
  for (int32_t t : prompt)
    TF_CHECK(t >= 0 && t < config().n_vocab, "prompt token id ", t, " is outside the vocabulary (0..",
             config().n_vocab - 1, ")");
  TF_CHECK(int64_t(prompt.size()) < context_, "the prompt has ", prompt.size(),
           " tokens but the context is ", context_, "; shorten it or raise context");
  TF_CHECK(params.max_tokens >= 0, "max_tokens must be >= 0");
  const int64_t id = next_id_++;
  seqs_.emplace(id, std::make_unique<Sequence>(id, prompt, params));
  return id;
}

void Engine::abort(int64_t request_id) {
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

std::vector<float> Engine::logits(const std::vector<int32_t>& ids) {
  require_leader("logits");
  TF_CHECK(!ids.empty(), "logits: empty token list");
  TF_CHECK(int64_t(ids.size()) <= context_, "logits: ", ids.size(), " tokens exceed the context ", context_);
  for (int32_t t : ids)
    TF_CHECK(t >= 0 && t < config().n_vocab, "token id ", t, " is outside the vocabulary");
  const int64_t V = config().n_vocab;
  std::vector<float> result(ids.size() * size_t(V));
  const int slot = kv_->create_sequence();
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
      run_forward(batch, logits_.data());
      std::copy(logits_.begin(), logits_.begin() + long(batch.size() * size_t(V)),
                result.begin() + long(b * size_t(V)));
    }
  } catch (...) {
    kv_->free_sequence(slot);
    throw;
  }
  kv_->free_sequence(slot);
  return result;
}

std::vector<std::vector<int32_t>> Engine::routing(const std::vector<int32_t>& ids) {
  model_->set_routing_trace(true);
  try {
    logits(ids);
  } catch (...) {
    model_->set_routing_trace(false);
    throw;
  }
  std::vector<std::vector<int32_t>> trace = model_->routing_trace();
  model_->set_routing_trace(false);
  return trace;
}

}  // namespace tf
