// Speculative decoding: where drafted tokens come from, and how many to draft.
//
// A draft source proposes, for each sequence in a step, up to k tokens that may follow its
// tokens. The engine verifies them in one forward of the target model (the sequence's last
// token and its drafts, each with logits), keeps the prefix the target agrees with (greedy:
// equal to its argmax; sampling: rejection sampling, Sampler::sample_given_draft), rolls the
// rest back in every cache (KvCache::truncate) and tells the source how much survived (sync).
// The output is the target's, whatever the source proposes: drafts change only the speed.
//
// Sources: prompt lookup (n-gram matches in the sequence's own tokens, no weights) and a draft
// model (a smaller GGUF with the same vocabulary, its own KV cache, drafting greedily).
//
// Draft length (DraftPolicy): each step, a draft token j of a sequence whose drafts are
// accepted at rate a is worth a^j expected tokens; it costs its share of the verify forward
// (b seconds per extra token, fitted online from the engine's own step times: t = c + b T) and
// of the drafting (the source's measured seconds per drafted token). Draft tokens are taken,
// most valuable first, while they raise the expected tokens per second of the step; so with
// many sequences in the batch (each token then costs about b, the same as what it can earn at
// best) drafting stops by itself, and a sequence whose drafts keep failing stops drafting (one
// probe every kProbeEvery steps keeps its rate current).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "kv/kv_cache.h"

namespace tf {

class Backend;
class GgufFile;
class Model;

class DraftSource {
 public:
  struct Request {
    int64_t id;                          // the engine's request id
    const std::vector<int32_t>* tokens;  // the sequence so far (prompt + output); the last one is not yet computed
    int k;                               // at most this many drafts
    std::vector<int32_t> drafts;         // filled by propose (may stay shorter, or empty)
  };
  virtual ~DraftSource() = default;
  virtual std::string name() const = 0;
  // Fills each request's drafts.
  virtual void propose(std::vector<Request>& reqs) = 0;
  // Request `id`'s tokens [0, n) were just prefilled by the target: a source with a cache of its
  // own reads them now (counted as prefill, not as the cost of a draft).
  virtual void prefill(int64_t id, const std::vector<int32_t>& tokens, int64_t n) { (void)id, (void)tokens, (void)n; }
  // Request `id` keeps its first n_valid tokens as proposed from (the rest were rejected).
  virtual void sync(int64_t id, int64_t n_valid) { (void)id, (void)n_valid; }
  // Request `id` is finished, aborted or preempted: its state goes.
  virtual void release(int64_t id) { (void)id; }
  // Seconds spent drafting and tokens drafted so far (the policy's cost of a draft token).
  double seconds() const { return seconds_; }
  int64_t drafted() const { return drafted_; }
  // Seconds per drafted token, recent proposals weighing most (0 until one drafted).
  double cost_per_draft() const { return cost_; }
  // Seconds per token the source spends reading a sequence's tokens it has not seen (a draft
  // model's or MTP layer's cache falling behind while the sequence does not draft); 0: none.
  double catchup_cost() const { return catchup_; }

 protected:
  // Book one proposal: `seconds` for `drafted` tokens.
  void account(double seconds, int64_t drafted) {
    seconds_ += seconds;
    drafted_ += drafted;
    if (drafted > 0) cost_ = cost_ > 0 ? 0.8 * cost_ + 0.2 * seconds / double(drafted) : seconds / double(drafted);
  }
  void account_catchup(double seconds, int64_t tokens) {
    if (tokens <= 0) return;
    const double per = seconds / double(tokens);
    catchup_ = catchup_ > 0 ? 0.8 * catchup_ + 0.2 * per : per;
  }
  double seconds_ = 0, cost_ = 0, catchup_ = 0;
  int64_t drafted_ = 0;
};

// Prompt lookup: the longest suffix of the sequence (ngram_max tokens down to ngram_min) that
// occurred earlier in it; the tokens that followed its latest earlier occurrence are the drafts.
std::unique_ptr<DraftSource> make_prompt_lookup(int ngram_min = 1, int ngram_max = 4);

// A draft model: `path` with the target's vocabulary (refused otherwise), on the target's
// backend, with a KV cache of `kv_tokens` / `max_seqs` and forwards of up to `max_batch_tokens`.
struct DraftModelSizes {
  int64_t kv_tokens = 0, context = 0;
  int max_seqs = 0, max_batch_tokens = 0;
  KvType kv_type = KvType::F16;
};
std::unique_ptr<DraftSource> make_draft_model(const std::string& path, const GgufFile& target, Backend& be,
                                              const DraftModelSizes& sizes);
// Bytes a draft model of `path` adds to the memory plan: its weights, its KV pool and its
// activation scratch (by the same rules as the target's).
uint64_t draft_model_bytes(const std::string& path, const DraftModelSizes& sizes);

// The target's own next-token-prediction layer (DeepSeek MTP): one draft per step. It reads the
// target's last hidden states, which the engine hands over for every position it computes
// (observe_hidden), and keeps its own cache of that layer (positions of the sequence, never
// speculative: nothing to roll back).
class MtpSource : public DraftSource {
 public:
  virtual void observe_hidden(int64_t id, int64_t pos, const float* rows, int64_t count) = 0;
};
std::unique_ptr<MtpSource> make_mtp(Model& target, Backend& be, const DraftModelSizes& sizes);

// Per-sequence acceptance and the online cost model; chooses each sequence's draft length.
class DraftPolicy {
 public:
  static constexpr int kProbeEvery = 16;
  // adaptive false: always draft_max (where the source has that many).
  DraftPolicy(int draft_max, bool adaptive) : draft_max_(draft_max), adaptive_(adaptive) {}
  // Draft lengths for sequences with acceptance rates `rate` (expected accepted fraction) that
  // have not drafted for `idle` steps, `batch` decode tokens in the step without drafts,
  // `draft_cost` seconds per drafted token. A sequence that does not draft is probed with one
  // draft now and then, so that its rate stays current: at most every kProbeEvery steps, and
  // rarely enough that probes cost at most kProbeShare of the time — never where the source's
  // reading of the tokens it missed (catchup_cost per token) alone costs more than that.
  std::vector<int> lengths(const std::vector<double>& rate, const std::vector<int>& idle, int batch,
                           double draft_cost, double catchup_cost = 0) const;
  static constexpr double kProbeShare = 0.02;
  // A decode step of `tokens` tokens took `seconds`.
  void observe_step(int tokens, double seconds);
  int draft_max() const { return draft_max_; }
  // Fitted step cost c + b T (seconds): c and b.
  double fixed_cost() const;
  double token_cost() const;

 private:
  int draft_max_;
  bool adaptive_;
  // Exponentially weighted least squares of seconds on tokens.
  double w_ = 0, st_ = 0, stt_ = 0, sy_ = 0, sty_ = 0;
};

// A sequence's acceptance record: the rate (exponentially weighted), steps since it drafted.
struct DraftStats {
  double rate = 0.6;  // prior: the first drafts are worth trying
  int idle_steps = 0;
  int64_t drafted = 0, accepted = 0;
  void record(int drafted_now, int accepted_now);
};

}  // namespace tf
