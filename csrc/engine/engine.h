// The request-based engine: requests are added, step() advances every active sequence by
// one scheduled batch (decode tokens of running sequences first, then chunked prefill of
// waiting ones within the token budget and the free KV blocks), samples, and reports the
// new tokens. Sequences finish on an end-of-generation token, max_tokens or the context
// limit, or are aborted; their KV blocks return to the pool.
//
// Prefix cache (EngineOptions::prefix_cache, on by default): every full KV block a sequence
// computes is registered under its whole token prefix (kv/prefix_cache.h). A request whose
// tokens start with registered blocks maps them into its block table (shared, read-only)
// and prefills only the rest; at least its last token is always computed, so there are
// logits to sample from. The blocks outlive their sequences and are evicted, least recently
// released first, only when a reservation finds no empty block. Outputs are exactly those
// without the cache: a row of K/V has the same bits whichever batch computed it.
//
// Thread safety: every public method may be called from any thread; one mutex serialises
// them, so step() and a concurrent abort() / add_request() / logits() never interleave.
#pragma once
#include <cstdint>
#include <deque>
#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/group.h"

#include "backend/backend.h"
#include "engine/memory_plan.h"
#include "engine/sampler.h"
#include "engine/speculative.h"
#include "gguf/gguf_reader.h"
#include "kv/kv_cache.h"
#include "model/model.h"

namespace tf {

struct TpOptions {
  int size = 1;                    // 1 or 2
  int rank = 0;                    // 0 schedules and samples; 1 follows
  std::string addr;                // rank 1 listens here, rank 0 connects
  std::vector<std::string> rails;  // local rail addresses
  double timeout_s = 30.0;        // a collective without progress for this long: the peer is lost
  double wait_s = 0;               // rank 1: wait for rank 0 to connect this long (0: until interrupted)
  double load_timeout_s = 3600;    // both ranks loaded within this long of connecting (heartbeat meanwhile)
  std::string transport = "tcp";   // "tcp" or "ibverbs"
  bool compatible = false;         // TP=1: compute exactly as a TP=2 pair would (see TpShard)
  std::string token;               // shared secret both ranks must know (empty: none)
};

struct EngineOptions {
  std::string backend = "cpu"; // where the forward runs: "cpu", "cuda", "auto" (cpu may say "cpu:avx2")
  int threads = 0;             // 0: the CPUs this process may use (affinity, cgroup quota)
  int64_t kv_tokens = 0;       // KV pool size in tokens; 0: max(context, 4096)
  int64_t context = 0;         // per-sequence limit; 0: min(model's trained context, 8192)
  int max_batch_tokens = 512;  // token budget of one step (prefill chunk size); capped
                               // at kMaxBatchTokens and the context
  KvType kv_type = KvType::F16;
  // Bytes this rank may use (the memory plan is checked against it before anything is
  // allocated); 0: the memory available now; < 0: no budget.
  int64_t memory_budget = 0;
  bool prefix_cache = true;    // reuse the KV blocks of earlier identical prompt prefixes
  // Sequences at once the windowed caches (sliding windows, compressors' pending rows) are
  // sized for: each holds window + one step of rows per sequence, not kv_tokens.
  int max_seqs = 32;
  // Speculative decoding (engine/speculative.h): "" none, "lookup" (prompt lookup), "mtp" (the
  // model's own next-token-prediction layer), or the path of a draft model GGUF with the same
  // vocabulary. Prompt lookup is also open to every request
  // of an engine with a draft model. draft_max: drafts per sequence and step, at most.
  std::string draft;
  int draft_max = 8;
  bool draft_adaptive = true;  // false: always draft_max drafts (benchmarks, tests)
  TpOptions tp;
};

struct RequestParams {
  SamplingParams sampling;
  int max_tokens = 128;
  std::vector<int32_t> eog_ids;  // end-of-generation tokens
  bool ignore_eos = false;
  // Log-probabilities of the output tokens: -1 off; 0 the sampled token's; k in 1..20 also
  // the k most likely tokens' (see StepOutput).
  int top_logprobs = -1;
  // Speculation for this request: "" the engine's (EngineOptions::draft), "none", "lookup",
  // "draft" (the engine's draft model) or "mtp" (when the engine drafts with it). The output is the same either way.
  std::string speculative;
};

enum class FinishReason { None, Stop, Length, Abort };
const char* finish_reason_name(FinishReason r);

struct StepOutput {
  int64_t request_id;
  int32_t token;             // -1 when the event carries no token (abort)
  bool finished;
  FinishReason reason;
  // The request asked for log-probabilities (top_logprobs >= 0). Events with a token then
  // carry them under the model's own distribution (token_logprobs in engine/sampler.h):
  // the token's, and the top_logprobs most likely ones, most likely first.
  bool has_logprobs = false;
  float logprob = 0.f;
  std::vector<std::pair<int32_t, float>> top;
  // On the event that finishes a request that could speculate: its drafted and accepted tokens.
  int64_t spec_drafted = -1, spec_accepted = -1;
};

struct EngineStats {
  int64_t steps = 0, prompt_tokens = 0, generated_tokens = 0, preemptions = 0;
  double prefill_seconds = 0, decode_seconds = 0;
  // Prefix cache: admissions that reused >= 1 cached block, and the prompt tokens they did
  // not prefill. KV blocks: used (held by sequences), free (empty), cached (kept for reuse,
  // held by none, evictable); the three add up to the pool.
  int64_t prefix_cache_hits = 0, prefix_cached_tokens = 0;
  int64_t kv_blocks_used = 0, kv_blocks_free = 0, kv_blocks_cached = 0;
  // Speculative decoding: verify steps of a sequence, tokens drafted, drafts accepted.
  int64_t spec_verifies = 0, spec_drafted = 0, spec_accepted = 0;
  double draft_seconds = 0;
};

class Engine {
 public:
  static constexpr int kMaxBatchTokens = 4096;
  static constexpr int64_t kMaxKvTokens = int64_t(1) << 30;
  static constexpr int64_t kMaxContext = int64_t(1) << 24;
  static constexpr int kKvBlockSize = 16;
  static constexpr int kMaxLogitRows = 64;  // logits rows one step may produce (= max sequences per step)
  static constexpr int kMaxTopLogprobs = 20;
  static constexpr int kMaxDrafts = 32;  // draft_max at most

  Engine(const std::string& model_path, const EngineOptions& opts);
  ~Engine();

  // Immutable after construction: no lock needed.
  const ModelConfig& config() const { return model_->config(); }
  const GgufFile& file() const { return *file_; }
  int threads() const { return be_->threads(); }
  std::string backend_name() const { return be_->name(); }
  int64_t context() const { return context_; }
  int max_batch_tokens() const { return max_batch_tokens_; }
  int64_t kv_tokens() const { return kv_->kv_tokens(); }
  size_t kv_bytes() const { return kv_->bytes(); }
  // Cache bytes one token takes on this rank, all layers (each layer's KV spec).
  uint64_t kv_bytes_per_token() const { return memory_plan_.kv_bytes_per_token; }

  int64_t free_kv_tokens() const;
  EngineStats stats() const;
  // Tokens routed to each expert, per layer (empty rows for dense layers / models).
  std::vector<std::vector<int64_t>> expert_usage() const;

  int64_t add_request(const std::vector<int32_t>& prompt, const RequestParams& params);
  void abort(int64_t request_id);
  bool has_unfinished() const;
  size_t n_active() const;
  std::vector<StepOutput> step();

  // Logits of every position of `ids` as one fresh sequence, written to `out`
  // ([ids.size(), n_vocab] floats; the caller allocates, so the result exists only once).
  void logits(const std::vector<int32_t>& ids, float* out);
  // The next-token-prediction layer's logits for `ids` as one fresh sequence: row i predicts
  // token i + 2 from the target's hidden state at i and token i + 1 ([ids.size() - 1, n_vocab];
  // checks the MTP draft head against a reference). TP=1.
  void nextn_logits(const std::vector<int32_t>& ids, float* out);
  // The experts each MoE layer chooses for every position of `ids`: [n_layer][len * n_used]
  // (empty for dense layers).
  std::vector<std::vector<int32_t>> routing(const std::vector<int32_t>& ids);
  // Calibration (model/activation_stats.h): from start_activation_stats() (a fresh collector)
  // until stop_activation_stats() (which hands it over; empty when none was started), every
  // forward adds the inputs of every weight matrix to it; activation_stats() is a copy of it so
  // far. TP=1 only: refused on a TP engine.
  void start_activation_stats();
  ActivationStats stop_activation_stats();
  ActivationStats activation_stats() const;

  // Tensor parallel. Rank 1 runs follow(): it executes every forward rank 0 plans until rank 0
  // shuts down (returns) or is lost (throws within the timeout). Every plan received is
  // validated before use; a bad one is an error (the follower stops), never a crash.
  int tp_rank() const { return tp_.rank; }
  int tp_size() const { return tp_.size; }
  void follow();
  comm::GroupStats comm_stats() const;
  uint64_t weight_bytes() const { return model_->weight_bytes(); }
  const MemoryPlan& memory_plan() const { return memory_plan_; }
  // What both TP ranks must agree on (model file and engine geometry), checked at connect.
  static std::string tp_identity(const GgufFile& f, const EngineOptions& o);

 private:
  struct Sequence {
    int64_t id;
    std::vector<int32_t> tokens;  // prompt followed by generated tokens
    size_t n_prompt;
    size_t n_computed = 0;        // tokens whose K/V are in the cache
    int slot = -1;                // KV slot, -1 while waiting
    RequestParams params;
    Sampler sampler;
    int n_generated = 0;
    DraftSource* source = nullptr;  // where its drafts come from (null: no speculation)
    DraftStats draft_stats;
    std::vector<int32_t> drafts;    // this step's, verified after the forward
    Sequence(int64_t id_, const std::vector<int32_t>& p, const RequestParams& rp)
        : id(id_), tokens(p), n_prompt(p.size()), params(rp), sampler(rp.sampling) {}
  };
  void finish(Sequence& s, StepOutput&& o, std::vector<StepOutput>& out);
  // Appends a sampled token to s (its logits row lg) and reports it; true when s is finished.
  bool emit(Sequence& s, int32_t tok, const float* lg, std::vector<StepOutput>& out);
  // Drafts for the decode sequences in batch_ (one entry each so far): lengths by the policy,
  // proposals by their sources, the batch rebuilt with every sequence's drafts after its token.
  void add_drafts(int& budget, int& logit_rows);
  // Verification of s's drafts against logits rows from `lg` (its token's row first).
  // True when s finished.
  // hidden: the target's last hidden states of its rows (for the MTP source), or null.
  bool verify(Sequence& s, const float* lg, const float* hidden, std::vector<StepOutput>& out);
  void release_slot(Sequence& s);
  void logits_locked(const std::vector<int32_t>& ids, float* out);
  // TP follower: checks plan_ field by field, fills batch_ and mirrors the block tables.
  void apply_plan();
  void check_sizes(const EngineOptions& opts, int64_t n_blocks) const;
  KvSizing kv_sizing(const EngineOptions& opts, int64_t n_blocks) const;
  // TP=2: loads this rank's slices while a heartbeat exchange with the peer runs, then returns
  // once both ranks have loaded (a barrier with its own deadline, load_timeout_s).
  void load_with_heartbeat(TpShard shard);
  // Rank 0: runs one forward on every rank (plan broadcast first under TP).
  void run_forward(const std::vector<BatchToken>& batch, float* logits, float* hidden = nullptr);
  // Throws when a weight read faulted past the end of a shrunk model file (gguf/mapping_guard.h).
  void check_weights_intact() const;
  void send_command(int64_t cmd, const std::vector<int32_t>& payload);
  void heartbeat_loop();
  void require_leader(const char* what) const;
  void preempt(Sequence& s);

  std::shared_ptr<GgufFile> file_;
  // Set by the load heartbeat when the peer is gone: this rank's load stops (declared before
  // model_, which points at it, so it outlives the model).
  std::atomic<bool> load_abandoned_{false};
  std::unique_ptr<Backend> be_;        // runs every operation of the forward
  std::unique_ptr<Model> model_;
  std::unique_ptr<ActivationStats> act_stats_;  // calibration collector while attached
  std::unique_ptr<KvCache> kv_;
  std::unique_ptr<DraftSource> lookup_, draft_model_;  // speculation sources (null: none)
  std::unique_ptr<MtpSource> mtp_;
  std::vector<float> hidden_;  // the last hidden states of a step's tokens (MTP reads them)
  // add_drafts' working lists, reused every step (the batch with drafts is swapped with batch_).
  std::vector<size_t> draft_who_;
  std::vector<double> draft_rate_;
  std::vector<int> draft_idle_;
  std::vector<BatchToken> draft_batch_;
  std::vector<Sequence*> draft_owner_;
  DraftSource* default_source_ = nullptr;
  std::unique_ptr<DraftPolicy> draft_policy_;
  mutable std::mutex mu_;              // guards everything below that changes after start-up
  int64_t context_ = 0;
  int max_batch_tokens_ = 512;
  int64_t next_id_ = 1;
  MemoryPlan memory_plan_;              // checked against the budget before any allocation
  std::map<int64_t, std::unique_ptr<Sequence>> seqs_;  // ordered by arrival (id)
  std::vector<BatchToken> batch_;
  std::vector<Sequence*> batch_owner_;
  std::vector<float> logits_;
  // This step's plain samples (sample_batch), reused between steps.
  struct Sampled {
    Sequence* seq;
    const float* logits;
    int32_t token;
  };
  std::vector<Sampled> sampled_;
  void sample_batch(int64_t V);
  EngineStats stats_;
  // TP state
  TpOptions tp_;
  std::unique_ptr<comm::Group> group_;
  std::mutex comm_mu_;                 // one collective sequence at a time (forward vs heartbeat)
  std::thread heartbeat_;
  std::condition_variable hb_cv_;
  std::mutex hb_mu_;
  bool hb_stop_ = false;
  std::vector<int32_t> plan_;          // serialized plan (reused)
  std::vector<int32_t> plan_seqs_;     // distinct sequences of a plan (reused)
  std::vector<int64_t> done_;          // finished this step (reused)
  // TP follower: plan validation scratch (per-slot / per-block marks, reused every plan).
  std::vector<uint32_t> slot_mark_, block_mark_, block_shared_;
  std::vector<int32_t> slot_table_len_, block_slot_;
  std::vector<int64_t> slot_table_at_;  // where each slot's table starts in plan_
  uint32_t plan_gen_ = 0, block_gen_ = 0;
  int64_t max_plan_ints_ = 0;
};

}  // namespace tf
