#include "engine/engine.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <random>
#include <sstream>
#include <thread>

#include "core/cpu_features.h"
#include "core/error.h"

namespace tf {

namespace {
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

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::Stop: return "stop";
    case FinishReason::Length: return "length";
    case FinishReason::Abort: return "abort";
    default: return "";
  }
}

KvSizing Engine::kv_sizing(const EngineOptions& opts, int64_t n_blocks) const {
  return KvSizing{n_blocks * kKvBlockSize, opts.max_seqs, max_batch_tokens_};
}

void Engine::check_sizes(const EngineOptions& opts, int64_t n_blocks) const {
  // Sizes that cannot work on this machine at all (or overflow), named one by one, before
  // the plan is weighed against the budget.
  const ModelConfig& c = model_->config();
  const std::vector<KvSpec> specs = model_->kv_specs();
  const std::vector<KvGroupPlan> groups = KvCache::plan(specs, kv_sizing(opts, n_blocks), opts.kv_type, false);
  const int elem = opts.kv_type == KvType::F32 ? 4 : 2;
  double want_exact = 0;
  uint64_t pool_bytes = 0;
  bool overflow = false;
  std::ostringstream why;
  why << "(kv_tokens " << n_blocks * kKvBlockSize << " x ";
  for (size_t i = 0; i < groups.size(); ++i) {
    const KvGroupPlan& g = groups[i];
    const KvSpec& sp = g.spec;
    if (i) why << " + ";
    why << g.layers.size() << " layers x " << sp.n_heads << (specs.size() && sp.v_dim == 0 ? " rows" : " KV heads") << " x ";
    if (sp.v_dim == sp.k_dim)
      why << "head dim " << sp.k_dim << " x K and V";
    else if (sp.v_dim == 0)
      why << sp.k_dim << " values";
    else
      why << "(K " << sp.k_dim << " + V " << sp.v_dim << ") values";
    if (sp.compression > 1) why << " / " << sp.compression;
    want_exact += double(g.layers.size()) * double(sp.values_per_entry()) * elem * double(g.n_blocks) *
                  kKvBlockSize;
    overflow |= g.bytes == 0 || __builtin_add_overflow(pool_bytes, g.bytes, &pool_bytes);
  }
  why << " x " << elem << " bytes)";
  if (overflow)
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
  const double scratch = model_->reserve(max_batch_tokens_, context_, /*count_only=*/true);
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
  TF_CHECK(opts.max_seqs >= 1 && opts.max_seqs <= KvCache::kMaxSeqs, "max_seqs must be an integer in [1, ",
           KvCache::kMaxSeqs, "], got ", opts.max_seqs);
  TF_CHECK(opts.context >= 0 && opts.context <= kMaxContext, "context must be an integer in [2, ", kMaxContext,
           "] (0: the model's), got ", opts.context);
  TF_CHECK(opts.kv_tokens >= 0 && opts.kv_tokens <= kMaxKvTokens, "kv_tokens must be an integer in [1, ",
           kMaxKvTokens, "] (0: automatic), got ", opts.kv_tokens);
  TF_CHECK(opts.draft_max >= 1 && opts.draft_max <= kMaxDrafts, "draft_max must be an integer in [1, ", kMaxDrafts,
           "], got ", opts.draft_max);

  file_ = GgufFile::open(model_path);
  tp_ = opts.tp;
  TF_CHECK(tp_.size == 1 || tp_.size == 2, "tensor parallel size must be 1 or 2, got ", tp_.size);
  TF_CHECK(tp_.rank >= 0 && tp_.rank < tp_.size, "TP rank ", tp_.rank, " is out of range for size ", tp_.size);
  BackendOptions bo;
  bo.name = opts.backend;
  bo.threads = opts.threads;
  be_ = make_backend(bo);
  TpShard shard;
  shard.tp_compatible = tp_.compatible;
  // The model's geometry and this rank's bytes first, from views of the file (TP=2: the slice
  // sizes, nothing read, no peer needed): the whole memory plan is checked before any large
  // allocation, before a TP pair even connects. At TP=1 this model is the one that runs.
  TpShard planning = shard;
  planning.size = tp_.size;
  planning.rank = tp_.rank;
  planning.plan_only = tp_.size > 1;
  model_ = std::make_unique<Model>(file_, be_.get(), planning);
  const ModelConfig c = model_->config();  // a copy: at TP=2 the planning model is replaced below
  const EngineGeometry geometry = resolve_geometry(c, opts);
  context_ = geometry.context;
  max_batch_tokens_ = geometry.max_batch_tokens;
  const int64_t n_blocks = geometry.kv_tokens / kKvBlockSize;
  check_sizes(opts, n_blocks);
  memory_plan_ = plan_memory(*model_, geometry, opts);
  if (!memory_plan_.fits())
    fail(ErrorKind::OutOfMemory, "the memory plan of this engine exceeds its budget (", memory_plan_.budget_source,
         "); lower kv_tokens, context or max_batch_tokens, or raise memory_budget:\n", memory_plan_.table());
  // A backend with memory of its own (a GPU) checks its share before anything is allocated.
  // (TP=1: the whole mapped file is handed over, so its size is what a discrete GPU holds.)
  be_->check_memory(tp_.size == 1 ? std::max<uint64_t>(memory_plan_.weights, file_->file_size()) : memory_plan_.weights,
                    memory_plan_.kv, memory_plan_.scratch, memory_plan_.budget);
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
    // A mismatch names the option to change (the items of tp_identity), and the ranks by the
    // roles the user gave them: the comm layer's listener (its rank 0) is the TP worker.
    g.handshake_hints = {{"model_bytes", {"model file size (bytes)", "the same GGUF file"}},
                         {"header_hash", {"model header hash", "the same GGUF file"}},
                         {"tp", {"tensor parallel size", "--tp 2"}},
                         {"context", {"context", "the same -c/--context"}},
                         {"kv_tokens", {"kv_tokens", "the same --kv-tokens"}},
                         // capped at the context: it often differs only because the context does
                         {"max_batch_tokens", {"max_batch_tokens", ""}},
                         {"kv_type", {"kv_type", "the same kv_type"}}};
    const char* worker = "the TP worker (rank 1, `tensorfold worker`)";
    g.self_name = tp_.rank == 0 ? "TP rank 0" : worker;
    g.peer_name = tp_.rank == 0 ? worker : "TP rank 0";
    g.token = tp_.token;
    group_ = comm::Group::create(g);
    shard.rank = tp_.rank;
    shard.size = 2;
    shard.group = group_.get();
    shard.group_rank_offset = 1;
  }
  if (tp_.size == 2) load_with_heartbeat(shard);  // reads this rank's slices
  else file_->prefault();  // the mapped weights resident now, as planned, not page by page while serving
  model_->hand_weights_to_backend();  // after the plan was checked: a GPU uploads them now
  kv_ = std::make_unique<KvCache>(model_->kv_specs(), kv_sizing(opts, n_blocks), opts.kv_type, *be_);
  kv_->prefault();
  // Rank 0 decides which blocks hold what; a follower mirrors its tables and caches nothing.
  // The hash seed is private to this engine, so nobody can aim key collisions at it.
  if (opts.prefix_cache && tp_.rank == 0) {
    std::random_device rd;
    kv_->enable_prefix_cache((uint64_t(rd()) << 32) ^ uint64_t(rd()));
  }
  // Ctrl-C may stop a local forward (TP=1) or the follower (which then exits), but never
  // rank 0 of a TP pair mid-collective: that would desynchronise the pair.
  be_->set_interruptible(!(tp_.size == 2 && tp_.rank == 0));
  model_->reserve(max_batch_tokens_, context_);
  // Speculation happens on rank 0 (a follower only runs the verify forwards it is sent).
  if (tp_.rank == 0) {
    lookup_ = make_prompt_lookup();
    if (opts.draft == "lookup") {
      default_source_ = lookup_.get();
    } else if (opts.draft == "mtp") {
      mtp_ = make_mtp(*model_, *be_, draft_sizes(opts, geometry));
      default_source_ = mtp_.get();
      hidden_.assign(size_t(max_batch_tokens_) * size_t(model_->hidden_width()), 0.f);
    } else if (!opts.draft.empty()) {
      draft_model_ = make_draft_model(opts.draft, *file_, *be_, draft_sizes(opts, geometry));
      default_source_ = draft_model_.get();
    }
    draft_policy_ = std::make_unique<DraftPolicy>(opts.draft_max, opts.draft_adaptive);
  }
  logits_.assign(size_t(kMaxLogitRows) * size_t(c.n_vocab), 0.f);
  batch_.reserve(size_t(max_batch_tokens_));
  batch_owner_.reserve(size_t(max_batch_tokens_));
  if (tp_.size == 2 && tp_.rank == 1) {
    // Largest plan rank 0 can send: T, 4 ints per token, n_seq, 2 ints per sequence and the
    // block tables (at most context/16 blocks per sequence, at most one sequence per token and
    // per slot; blocks of a cached prefix appear in the table of every sequence sharing it).
    const int64_t M = max_batch_tokens_;
    const int64_t max_table = (context_ + kKvBlockSize - 1) / kKvBlockSize;
    max_plan_ints_ = 2 + 6 * M + std::min<int64_t>(M, kv_->max_seqs()) * kv_->n_groups() * (max_table + 1);
    slot_mark_.assign(size_t(kv_->max_seqs()), 0);
    slot_table_len_.assign(size_t(kv_->max_seqs()), 0);
    slot_table_at_.assign(size_t(kv_->max_seqs()), 0);
    int64_t most = 0;
    for (int g = 0; g < kv_->n_groups(); ++g) most = std::max(most, kv_->group(g).n_blocks());
    block_mark_.assign(size_t(most), 0);
    block_shared_.assign(size_t(most), 0);
    block_slot_.assign(size_t(most), -1);
  }
  if (tp_.size == 2 && tp_.rank == 0) heartbeat_ = std::thread(&Engine::heartbeat_loop, this);
}

void Engine::require_leader(const char* what) const {
  if (tp_.rank != 0)
    fail(ErrorKind::InvalidInput, what, ": this engine is TP rank ", tp_.rank,
         ", which only follows rank 0; send requests to rank 0");
}

int64_t Engine::free_kv_tokens() const {
  std::lock_guard<std::mutex> lock(mu_);
  return kv_->free_tokens();
}

EngineStats Engine::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  EngineStats s = stats_;
  s.kv_blocks_free = kv_->empty_blocks();
  s.kv_blocks_cached = kv_->cached_blocks();
  s.kv_blocks_used = kv_->used_blocks();
  return s;
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
  TF_CHECK(sp.presence_penalty >= -2.f && sp.presence_penalty <= 2.f,
           "presence_penalty must be in [-2, 2] (0 = off), got ", sp.presence_penalty);
  TF_CHECK(sp.frequency_penalty >= -2.f && sp.frequency_penalty <= 2.f,
           "frequency_penalty must be in [-2, 2] (0 = off), got ", sp.frequency_penalty);
  TF_CHECK(params.top_logprobs >= -1 && params.top_logprobs <= kMaxTopLogprobs,
           "top_logprobs must be -1 (off), 0 (the sampled token's) or 1..", kMaxTopLogprobs, ", got ",
           params.top_logprobs);
  TF_CHECK(params.resumed >= 0 && params.resumed < int64_t(prompt.size()), "resumed must be in [0, ",
           prompt.size(), ") (prompt tokens that were generated), got ", params.resumed);
  const std::string& spec = params.speculative;
  TF_CHECK(spec.empty() || spec == "none" || spec == "lookup" || spec == "draft" || spec == "mtp",
           "speculative must be '' (the engine's), 'none', 'lookup', 'draft' or 'mtp', got '", spec, "'");
  TF_CHECK(spec != "draft" || draft_model_, "speculative 'draft': this engine has no draft model (start it with one)");
  TF_CHECK(spec != "mtp" || mtp_, "speculative 'mtp': this engine does not draft with the model's next-token-"
           "prediction layers (start it with draft='mtp')");
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t id = next_id_++;
  auto seq = std::make_unique<Sequence>(id, prompt, params);
  for (size_t i = prompt.size() - size_t(params.resumed); i < prompt.size(); ++i)
    seq->sampler.observe(prompt[i], config().n_vocab);
  seq->source = spec.empty() ? default_source_ : spec == "lookup" ? lookup_.get()
                : spec == "draft"              ? draft_model_.get()
                : spec == "mtp"                ? static_cast<DraftSource*>(mtp_.get())
                                               : nullptr;
  seqs_.emplace(id, std::move(seq));
  return id;
}

void Engine::abort(int64_t request_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = seqs_.find(request_id);
  if (it == seqs_.end()) return;
  if (it->second->slot >= 0) kv_->free_sequence(it->second->slot);
  if (it->second->source) it->second->source->release(request_id);
  seqs_.erase(it);
}

void Engine::release_slot(Sequence& s) {
  // Its blocks lose a reference: registered ones stay cached, the others are free again.
  if (s.slot >= 0) kv_->free_sequence(s.slot);
  s.slot = -1;
  s.n_computed = 0;
  if (s.source) s.source->release(s.id);
}

void Engine::finish(Sequence& s, StepOutput&& o, std::vector<StepOutput>& out) {
  o.finished = true;
  if (s.source) {
    o.spec_drafted = s.draft_stats.drafted;
    o.spec_accepted = s.draft_stats.accepted;
  }
  out.push_back(std::move(o));
  release_slot(s);
}

void Engine::preempt(Sequence& s) {
  // Recompute later: drop its cache; its generated tokens become part of what is re-read (and
  // its full blocks, cached, are likely still there to be reused).
  release_slot(s);
  ++stats_.preemptions;
}

void Engine::check_weights_intact() const {
  if (file_->mapping_lost())
    fail(ErrorKind::InvalidInput, file_->display_path(), ": the model file shrank while this engine was using it "
         "(a read past its new end was caught); the results of this step are discarded and the engine cannot "
         "go on: restart it with an intact file");
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
      StepOutput o{it->first, -1, true, FinishReason::Length};
      o.has_logprobs = it->second->params.top_logprobs >= 0;
      finish(*it->second, std::move(o), out);
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
    // The last prompt token can come this way too (one token left): exact only when generated.
    batch_.push_back({s.tokens.back(), int32_t(s.n_computed), int32_t(s.slot), true, s.generated(s.n_computed)});
    batch_owner_.push_back(&s);
    --budget;
    ++logit_rows;
  }
  if (draft_policy_ && !batch_.empty()) add_drafts(budget, logit_rows);
  const size_t n_decode = batch_.size();

  // 2. Prefill (chunked): everything else, oldest first, within the remaining budget.
  for (auto& [id, sp] : seqs_) {
    Sequence& s = *sp;
    if (budget == 0 || logit_rows == kMaxLogitRows) break;
    if (s.slot >= 0 && s.tokens.size() - s.n_computed == 1) continue;  // decode, handled above
    if (std::find(batch_owner_.begin(), batch_owner_.end(), &s) != batch_owner_.end()) continue;
    const bool new_slot = s.slot < 0;
    if (new_slot) s.slot = kv_->create_sequence();
    if (s.slot < 0) break;  // every sequence slot is taken: wait for one to finish
    size_t cached = 0;
    if (new_slot) {
      // The cached blocks the sequence's tokens start with, mapped into its new tables.
      cached = size_t(kv_->attach_prefix(s.slot, s.tokens.data(), int64_t(s.tokens.size())));
      s.n_computed = cached;
    }
    const size_t pending = s.tokens.size() - s.n_computed;
    const size_t chunk = std::min<size_t>(pending, size_t(budget));
    if (!kv_->reserve(s.slot, int64_t(s.n_computed + chunk))) {
      if (new_slot) release_slot(s);  // the shared blocks go back to the cache
      break;  // keep arrival order: later requests wait too
    }
    if (cached > 0) {
      ++stats_.prefix_cache_hits;
      stats_.prefix_cached_tokens += int64_t(cached);
    }
    for (size_t i = 0; i < chunk; ++i) {
      const size_t pos = s.n_computed + i;
      const bool last = pos + 1 == s.tokens.size();
      // A resubmitted stream's generated tokens are computed as they were when decoded.
      batch_.push_back({s.tokens[pos], int32_t(pos), int32_t(s.slot), last, s.generated(pos)});
      batch_owner_.push_back(&s);
      if (last) ++logit_rows;
    }
    budget -= int(chunk);
  }
  if (batch_.empty()) return out;

  const auto t0 = std::chrono::steady_clock::now();
  run_forward(batch_, logits_.data(), mtp_ ? hidden_.data() : nullptr);
  check_weights_intact();
  // A draft model reads what the target prefilled now, as part of the prefill (not of a later
  // decode step, where it would stall the stream and count as the cost of a draft).
  if (draft_model_)
    for (size_t i = n_decode; i < batch_.size(); ++i)
      if (batch_owner_[i]->source == draft_model_.get() && (i + 1 == batch_.size() || batch_owner_[i + 1] != batch_owner_[i]))
        draft_model_->prefill(batch_owner_[i]->id, batch_owner_[i]->tokens, int64_t(batch_[i].pos) + 1);
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ++stats_.steps;
  const size_t n_prefill = batch_.size() - n_decode;
  if (n_prefill > 0) {
    stats_.prefill_seconds += dt;
    stats_.prompt_tokens += int64_t(n_prefill);
  } else {
    stats_.decode_seconds += dt;
    if (draft_policy_) draft_policy_->observe_step(int(batch_.size()), dt);
  }

  // 3. Advance, sample and check stop conditions. A sequence's tokens are contiguous in the
  // batch.
  const int64_t V = config().n_vocab;
  sample_batch(V);
  int row = 0;
  std::vector<int64_t>& done = done_;
  done.clear();
  size_t next_sampled = 0;
  for (size_t i = 0; i < batch_.size();) {
    Sequence& s = *batch_owner_[i];
    size_t j = i;
    while (j < batch_.size() && batch_owner_[j] == &s) ++j;
    const float* hid = mtp_ && s.source == mtp_.get() ? hidden_.data() + i * size_t(model_->hidden_width()) : nullptr;
    if (!s.drafts.empty()) {  // its token and its drafts, each with logits
      s.n_computed = size_t(batch_[i].pos) + 1;
      if (verify(s, logits_.data() + size_t(row) * size_t(V), hid, out)) done.push_back(s.id);
      row += int(j - i);
      i = j;
      continue;
    }
    s.n_computed = size_t(batch_[j - 1].pos) + 1;
    if (hid) mtp_->observe_hidden(s.id, batch_[i].pos, hid, int64_t(j - i));
    // After its last token, its newly full blocks (prompt and generated tokens alike) join the
    // prefix cache, and window groups let go of what no later token reads.
    kv_->advance(s.slot, s.tokens.data(), int64_t(s.n_computed));
    if (batch_[j - 1].want_logits) {
      const float* lg = logits_.data() + size_t(row++) * size_t(V);
      if (emit(s, sampled_[next_sampled++].token, lg, out)) done.push_back(s.id);
    }
    i = j;
  }
  for (int64_t id : done) seqs_.erase(id);
  return out;
}

void Engine::sample_batch(int64_t V) {
  // The sequences that sample one token this step (not those verifying drafts), in batch
  // order, with their logits rows; sampled in parallel when there are several (each sequence
  // has its own sampler and RNG, so the draws do not depend on the threads).
  sampled_.clear();
  int64_t row = 0;
  for (size_t i = 0; i < batch_.size();) {
    Sequence& s = *batch_owner_[i];
    size_t j = i;
    while (j < batch_.size() && batch_owner_[j] == &s) ++j;
    if (!s.drafts.empty()) {
      row += int64_t(j - i);
    } else if (batch_[j - 1].want_logits) {
      sampled_.push_back({&s, logits_.data() + size_t(row++) * size_t(V), 0});
    }
    i = j;
  }
  auto one = [&](int64_t k) {
    Sampled& x = sampled_[size_t(k)];
    x.token = x.seq->sampler.sample(x.logits, V);
  };
  if (sampled_.size() > 1)
    be_->host_parallel(int64_t(sampled_.size()), one);
  else if (sampled_.size() == 1)
    one(0);
}

bool Engine::emit(Sequence& s, int32_t tok, const float* lg, std::vector<StepOutput>& out) {
  const int64_t V = config().n_vocab;
  StepOutput o{s.id, tok, false, FinishReason::None};
  if (s.params.top_logprobs >= 0) {
    o.has_logprobs = true;
    o.logprob = token_logprobs(lg, V, tok, s.params.top_logprobs, o.top);
  }
  s.tokens.push_back(tok);
  s.sampler.observe(tok, V);
  ++s.n_generated;
  ++stats_.generated_tokens;
  const auto& eog = s.params.eog_ids;
  FinishReason reason = FinishReason::None;
  if (!s.params.ignore_eos && std::find(eog.begin(), eog.end(), tok) != eog.end())
    reason = FinishReason::Stop;
  else if (s.n_generated >= s.params.max_tokens || int64_t(s.tokens.size()) >= context_)
    reason = FinishReason::Length;
  if (reason == FinishReason::None) {
    out.push_back(std::move(o));
    return false;
  }
  o.reason = reason;
  finish(s, std::move(o), out);
  return true;
}

void Engine::add_drafts(int& budget, int& logit_rows) {
  // Who may draft, and how many tokens each: the policy weighs each sequence's acceptance
  // against the measured cost of a verified token and of a drafted one.
  // Reused every step (no allocation per token once warmed up).
  std::vector<size_t>& who = draft_who_;
  std::vector<double>& rate = draft_rate_;
  std::vector<int>& idle = draft_idle_;
  who.clear();
  rate.clear();
  idle.clear();
  for (size_t i = 0; i < batch_.size(); ++i) {
    Sequence& s = *batch_owner_[i];
    s.drafts.clear();
    if (!s.source) continue;
    who.push_back(i);
    rate.push_back(s.draft_stats.rate);
    idle.push_back(s.draft_stats.idle_steps);
  }
  if (who.empty()) return;
  // The cost of a drafted token: the dearest source among the drafting sequences'.
  double draft_cost = 0, catchup_cost = 0;
  for (size_t i : who) {
    draft_cost = std::max(draft_cost, batch_owner_[i]->source->cost_per_draft());
    catchup_cost = std::max(catchup_cost, batch_owner_[i]->source->catchup_cost());
  }
  const std::vector<int> k = draft_policy_->lengths(rate, idle, int(batch_.size()), draft_cost, catchup_cost);
  // Proposals, per source.
  std::vector<DraftSource::Request> reqs;
  std::vector<size_t> req_at;
  for (DraftSource* src : {lookup_.get(), draft_model_.get(), static_cast<DraftSource*>(mtp_.get())}) {
    if (!src) continue;
    reqs.clear();
    req_at.clear();
    for (size_t w = 0; w < who.size(); ++w) {
      Sequence& s = *batch_owner_[who[w]];
      if (s.source != src) continue;
      // No more drafts than tokens the request may still produce, nor than the context holds.
      const int room = int(std::min<int64_t>({int64_t(k[w]), int64_t(s.params.max_tokens - s.n_generated - 1),
                                              context_ - int64_t(s.tokens.size()) - 1}));
      if (room <= 0) {
        ++s.draft_stats.idle_steps;
        continue;
      }
      reqs.push_back({s.id, &s.tokens, room, {}});
      req_at.push_back(who[w]);
    }
    if (reqs.empty()) continue;
    const double before = src->seconds();
    src->propose(reqs);
    stats_.draft_seconds += src->seconds() - before;
    for (size_t r = 0; r < reqs.size(); ++r) batch_owner_[req_at[r]]->drafts = std::move(reqs[r].drafts);
  }
  // The batch again: each sequence's token, then its drafts (that fit the budget and the pool).
  std::vector<BatchToken>& batch = draft_batch_;
  std::vector<Sequence*>& owner = draft_owner_;
  batch.clear();
  owner.clear();
  for (size_t i = 0; i < batch_.size(); ++i) {
    Sequence& s = *batch_owner_[i];
    batch.push_back(batch_[i]);
    owner.push_back(&s);
    int nd = int(std::min<size_t>(s.drafts.size(), size_t(std::min(budget, kMaxLogitRows - logit_rows))));
    if (nd > 0 && !kv_->reserve(s.slot, int64_t(s.n_computed) + 1 + nd)) nd = 0;
    s.drafts.resize(size_t(nd));
    if (nd == 0) {
      if (s.source) ++s.draft_stats.idle_steps;
      continue;
    }
    for (int d = 0; d < nd; ++d) {
      batch.push_back({s.drafts[size_t(d)], int32_t(s.n_computed) + 1 + d, int32_t(s.slot), true, true});
      owner.push_back(&s);
    }
    budget -= nd;
    logit_rows += nd;
  }
  batch_.swap(batch);
  batch_owner_.swap(owner);
}

bool Engine::verify(Sequence& s, const float* lg, const float* hidden, std::vector<StepOutput>& out) {
  const int64_t V = config().n_vocab;
  const int nd = int(s.drafts.size());
  int accepted = 0;
  bool finished = false;
  for (int r = 0; r <= nd; ++r, lg += V) {
    bool ok = false;
    const int32_t tok = r < nd ? s.sampler.sample_given_draft(lg, V, s.drafts[size_t(r)], ok) : s.sampler.sample(lg, V);
    finished = emit(s, tok, lg, out);
    if (!ok || finished) break;
    ++accepted;  // the draft is now the sequence's token, its K/V already in the cache
    ++s.n_computed;
  }
  ++stats_.spec_verifies;
  stats_.spec_drafted += nd;
  stats_.spec_accepted += accepted;
  s.draft_stats.record(nd, accepted);
  s.drafts.clear();
  if (finished) return true;  // its slot is released
  // The target's hidden states of the positions kept: its token's and the accepted drafts'.
  if (hidden) mtp_->observe_hidden(s.id, int64_t(s.n_computed) - 1 - accepted, hidden, 1 + accepted);
  // The rejected drafts' rows go from every cache; then the prefix cache and windows advance.
  if (!kv_->truncate(s.slot, int64_t(s.n_computed))) {
    preempt(s);  // cannot roll back (no block for a copy): recompute it later
    return false;
  }
  kv_->advance(s.slot, s.tokens.data(), int64_t(s.n_computed));
  if (s.source) s.source->sync(s.id, int64_t(s.n_computed));
  return false;
}

void Engine::logits(const std::vector<int32_t>& ids, float* out, int64_t generated_from) {
  require_leader("logits");
  TF_CHECK(!ids.empty(), "logits: empty token list");
  TF_CHECK(int64_t(ids.size()) <= context_, "logits: ", ids.size(), " tokens exceed the context ", context_);
  for (int32_t t : ids)
    TF_CHECK(t >= 0 && t < config().n_vocab, "token id ", t, " is outside the vocabulary (0..",
             config().n_vocab - 1, ")");
  std::lock_guard<std::mutex> lock(mu_);
  logits_locked(ids, out, generated_from);
}

void Engine::logits_locked(const std::vector<int32_t>& ids, float* out, int64_t generated_from) {
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
        batch.push_back({ids[i], int32_t(i), int32_t(slot), true, generated_from >= 0 && int64_t(i) >= generated_from});
      // Rows go straight to the caller's array (no second copy of the result).
      run_forward(batch, out ? out + b * V : logits_.data());
      check_weights_intact();
      kv_->advance(slot, nullptr, int64_t(b + batch.size()));
    }
  } catch (...) {
    kv_->free_sequence(slot);
    throw;
  }
  kv_->free_sequence(slot);
}

void Engine::nextn_logits(const std::vector<int32_t>& ids, float* out) {
  require_leader("nextn_logits");
  const std::string why = model_->nextn_unsupported(0);
  TF_CHECK(why.empty(), "nextn_logits: ", why);
  TF_CHECK(ids.size() >= 2 && int64_t(ids.size()) <= context_, "nextn_logits: give 2 to ", context_, " tokens");
  for (int32_t t : ids)
    TF_CHECK(t >= 0 && t < config().n_vocab, "token id ", t, " is outside the vocabulary");
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t E = model_->hidden_width(), V = config().n_vocab, n = int64_t(ids.size());
  const size_t chunk = size_t(std::min(max_batch_tokens_, kMaxLogitRows));
  // The target's hidden states at every position.
  std::vector<float> hidden(size_t(n * E));
  const int slot = kv_->create_sequence();
  TF_CHECK(slot >= 0 && kv_->reserve(slot, n), "nextn_logits: no room in the KV cache");
  std::vector<BatchToken> batch;
  try {
    for (size_t b = 0; b < ids.size(); b += chunk) {
      batch.clear();
      for (size_t i = b; i < std::min(ids.size(), b + chunk); ++i) batch.push_back({ids[i], int32_t(i), slot, false});
      model_->forward(batch, *kv_, nullptr, hidden.data() + b * size_t(E));
      kv_->advance(slot, nullptr, int64_t(b + batch.size()));
    }
  } catch (...) {
    kv_->free_sequence(slot);
    throw;
  }
  kv_->free_sequence(slot);
  // The layer over the pairs (hidden i, token i + 1), in a cache of its own.
  KvCache cache(model_->nextn_kv_specs(0), KvSizing{(n + kKvBlockSize) / kKvBlockSize * kKvBlockSize, 1, max_batch_tokens_},
                kv_->type(), *be_);
  const int s = cache.create_sequence();
  TF_CHECK(s >= 0 && cache.reserve(s, n - 1), "nextn_logits: no room in the layer's cache");
  for (size_t b = 0; b + 1 < ids.size(); b += chunk) {
    batch.clear();
    for (size_t i = b; i + 1 < ids.size() && i < b + chunk; ++i) batch.push_back({ids[i + 1], int32_t(i), s, true});
    model_->forward_nextn(0, batch, hidden.data() + b * size_t(E), cache, out + b * size_t(V));
    cache.advance(s, nullptr, int64_t(b + batch.size()));
  }
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

void Engine::start_activation_stats() {
  if (tp_.size > 1)
    fail(ErrorKind::Unsupported, "calibration statistics are not supported with tensor parallelism (TP=", tp_.size,
         "): load the model on one engine (TP=1)");
  std::lock_guard<std::mutex> lock(mu_);
  auto stats = std::make_unique<ActivationStats>();
  model_->set_activation_stats(stats.get());
  act_stats_ = std::move(stats);
}

ActivationStats Engine::stop_activation_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  model_->set_activation_stats(nullptr);
  ActivationStats out;
  if (act_stats_) out = std::move(*act_stats_);
  act_stats_.reset();
  return out;
}

ActivationStats Engine::activation_stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  TF_CHECK(act_stats_ != nullptr, "activation statistics: none are being collected (start them first)");
  return *act_stats_;
}

}  // namespace tf
