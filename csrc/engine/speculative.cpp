#include "engine/speculative.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "backend/backend.h"
#include "core/error.h"
#include "engine/memory_plan.h"
#include "engine/engine.h"
#include "engine/sampler.h"
#include "gguf/gguf_reader.h"
#include "model/model.h"

namespace tf {

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// ---- prompt lookup --------------------------------------------------------------------------
class PromptLookup final : public DraftSource {
 public:
  PromptLookup(int ngram_min, int ngram_max) : lo_(ngram_min), hi_(ngram_max) {}
  std::string name() const override { return "lookup"; }

  void propose(std::vector<Request>& reqs) override {
    const double t0 = now_s();
    int64_t n_drafted = 0;
    for (Request& r : reqs) {
      r.drafts.clear();
      const std::vector<int32_t>& t = *r.tokens;
      const int64_t n = int64_t(t.size());
      for (int64_t g = std::min<int64_t>(hi_, n - 1); g >= lo_ && r.drafts.empty(); --g) {
        const int32_t* suffix = t.data() + (n - g);
        // The latest earlier occurrence with a token after it.
        for (int64_t i = n - g - 1; i >= 0; --i) {
          if (t[size_t(i)] != suffix[0] || std::memcmp(t.data() + i, suffix, size_t(g) * sizeof(int32_t)) != 0)
            continue;
          const int64_t from = i + g, to = std::min<int64_t>(n, from + r.k);
          r.drafts.assign(t.begin() + from, t.begin() + to);
          break;
        }
      }
      n_drafted += int64_t(r.drafts.size());
    }
    account(now_s() - t0, n_drafted);
  }

 private:
  int lo_, hi_;
};

// ---- draft model ----------------------------------------------------------------------------
// The tokenizer's token list, as bytes of the file (empty when absent).
std::string token_list_bytes(const GgufFile& f) {
  const GgufValue* v = f.find("tokenizer.ggml.tokens");
  if (!v || v->type != GgufValueType::ARRAY || v->end < v->begin) return {};
  return std::string(reinterpret_cast<const char*>(f.base() + v->begin), size_t(v->end - v->begin));
}

class DraftModel final : public DraftSource {
 public:
  DraftModel(const std::string& path, const GgufFile& target, Backend& be, const DraftModelSizes& z)
      : be_(be), sizes_(z) {
    try {
      file_ = GgufFile::open(path);
      model_ = std::make_unique<Model>(file_, &be_);
    } catch (const Error& e) {
      fail(e.kind(), "draft model: ", e.what());  // say which of the two files it is about
    }
    const ModelConfig& c = model_->config();
    const int64_t target_vocab = target.find("tokenizer.ggml.tokens")
                                     ? int64_t(target.find("tokenizer.ggml.tokens")->array_size())
                                     : -1;
    const std::string mine = token_list_bytes(*file_), theirs = token_list_bytes(target);
    if (mine.empty() || theirs.empty() || mine != theirs)
      fail(ErrorKind::InvalidInput, "draft model ", path, ": its vocabulary (",
           file_->find("tokenizer.ggml.tokens") ? std::to_string(file_->find("tokenizer.ggml.tokens")->array_size())
                                                : std::string("no"),
           " tokens) differs from the target's (", target_vocab,
           " tokens): a draft must share the target's tokenizer (e.g. a lower-bit quantization of the same model)");
    TF_CHECK(c.n_vocab >= target_vocab, "draft model ", path, ": output of ", c.n_vocab,
             " logits is smaller than the vocabulary");
    file_->prefault();
    model_->hand_weights_to_backend();  // a GPU backend uploads or registers them
    kv_ = std::make_unique<KvCache>(model_->kv_specs(), KvSizing{z.kv_tokens, z.max_seqs, z.max_batch_tokens},
                                    z.kv_type, be_);
    kv_->prefault();
    model_->reserve(z.max_batch_tokens, z.context);
    logits_.assign(size_t(Model::kMaxLogitRows) * size_t(c.n_vocab), 0.f);
  }
  std::string name() const override { return "draft"; }

  void propose(std::vector<Request>& reqs) override {
    const double t0 = now_s();
    int64_t n_drafted = 0;
    const int64_t V = model_->config().n_vocab;
    struct Live {
      Request* r;
      State* st;
      int64_t next_pos;  // the position the next fed token takes
    };
    std::vector<Live> live;
    for (Request& r : reqs) {
      r.drafts.clear();
      if (r.k <= 0) continue;
      State* st = state(r.id);
      const int64_t n = int64_t(r.tokens->size());
      if (!st || st->n_computed >= n || !kv_->reserve(st->slot, n + r.k - 1)) {
        if (st) release(r.id);  // no room: this request drafts nothing this step
        continue;
      }
      live.push_back({&r, st, st->n_computed});
    }
    // Round 0: the tokens the draft has not seen (at least the last one), chunked; then one
    // token per round, the previous round's draft.
    for (int round = 0; !live.empty(); ++round) {
      std::vector<BatchToken> batch;
      std::vector<Live*> rows;  // the request of each logits row
      auto flush = [&] {
        if (batch.empty()) return;
        model_->forward(batch, *kv_, logits_.data());
        for (size_t i = 0; i < rows.size(); ++i)
          rows[i]->r->drafts.push_back(Sampler::argmax(logits_.data() + i * size_t(V), V));
        batch.clear();
        rows.clear();
      };
      for (Live& l : live) {
        const std::vector<int32_t>& t = *l.r->tokens;
        const int64_t n = int64_t(t.size());
        const int64_t from = l.next_pos, to = round == 0 ? n : l.next_pos + 1;
        for (int64_t p = from; p < to; ++p) {
          if (int(batch.size()) == sizes_.max_batch_tokens || int(rows.size()) == Model::kMaxLogitRows) flush();
          const int32_t tok = p < n ? t[size_t(p)] : l.r->drafts[size_t(p - n)];
          batch.push_back({tok, int32_t(p), int32_t(l.st->slot), p + 1 == to});
          if (p + 1 == to) rows.push_back(&l);
        }
        l.next_pos = to;
      }
      flush();
      for (Live& l : live) {
        l.st->n_computed = l.next_pos;
        kv_->advance(l.st->slot, nullptr, l.st->n_computed);
      }
      n_drafted += int64_t(live.size());
      live.erase(std::remove_if(live.begin(), live.end(),
                                [](const Live& l) { return int(l.r->drafts.size()) >= l.r->k; }),
                 live.end());
    }
    account(now_s() - t0, n_drafted);
  }

  void prefill(int64_t id, const std::vector<int32_t>& tokens, int64_t n) override {
    State* st = state(id);
    if (!st || st->n_computed >= n) return;
    const double t0 = now_s();
    const int64_t from = st->n_computed;
    if (!kv_->reserve(st->slot, n)) {
      release(id);
      return;
    }
    std::vector<BatchToken> batch;
    for (int64_t p = st->n_computed; p < n; p += sizes_.max_batch_tokens) {
      batch.clear();
      for (int64_t q = p; q < std::min<int64_t>(n, p + sizes_.max_batch_tokens); ++q)
        batch.push_back({tokens[size_t(q)], int32_t(q), int32_t(st->slot), false});
      model_->forward(batch, *kv_, nullptr);
    }
    st->n_computed = n;
    kv_->advance(st->slot, nullptr, n);
    account_catchup(now_s() - t0, n - from);
  }

  void sync(int64_t id, int64_t n_valid) override {
    auto it = seqs_.find(id);
    if (it == seqs_.end() || it->second.n_computed <= n_valid) return;
    if (kv_->truncate(it->second.slot, n_valid))
      it->second.n_computed = n_valid;
    else
      release(id);  // cannot roll back (a window let go of): start again from the prompt
  }

  void release(int64_t id) override {
    auto it = seqs_.find(id);
    if (it == seqs_.end()) return;
    kv_->free_sequence(it->second.slot);
    seqs_.erase(it);
  }

 private:
  struct State {
    int slot;
    int64_t n_computed;  // tokens of the request in this cache
  };
  State* state(int64_t id) {
    auto it = seqs_.find(id);
    if (it != seqs_.end()) return &it->second;
    const int slot = kv_->create_sequence();
    if (slot < 0) return nullptr;
    return &seqs_.emplace(id, State{slot, 0}).first->second;
  }

  Backend& be_;
  DraftModelSizes sizes_;
  std::shared_ptr<GgufFile> file_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<KvCache> kv_;
  std::vector<float> logits_;
  std::unordered_map<int64_t, State> seqs_;
};

// ---- next-token prediction (MTP) --------------------------------------------------------------
class Mtp final : public MtpSource {
 public:
  Mtp(Model& target, Backend& be, const DraftModelSizes& z) : model_(target), sizes_(z) {
    const std::string why = target.nextn_unsupported(0);
    if (!why.empty()) fail(ErrorKind::Unsupported, "draft 'mtp': ", why);
    kv_ = std::make_unique<KvCache>(target.nextn_kv_specs(0), KvSizing{z.kv_tokens, z.max_seqs, z.max_batch_tokens},
                                    z.kv_type, be);
    kv_->prefault();
    E_ = target.hidden_width();
    logits_.assign(size_t(Model::kMaxLogitRows) * size_t(target.config().n_vocab), 0.f);
  }
  std::string name() const override { return "mtp"; }

  void observe_hidden(int64_t id, int64_t pos, const float* rows, int64_t count) override {
    State& st = seqs_[id];
    if (pos != st.done + int64_t(st.hidden.size() / size_t(E_))) {  // not the next positions: start over
      drop(id);
      if (pos != 0) return;  // the layer's cache needs every position from the start
    }
    State& s2 = seqs_[id];
    s2.hidden.insert(s2.hidden.end(), rows, rows + size_t(count * E_));
  }

  void propose(std::vector<Request>& reqs) override {
    const double t0 = now_s();
    const int64_t V = model_.config().n_vocab;
    std::vector<BatchToken> batch;
    std::vector<float> hid;
    std::vector<Request*> rows;
    auto flush = [&] {
      if (batch.empty()) return;
      model_.forward_nextn(0, batch, hid.data(), *kv_, logits_.data());
      for (size_t i = 0; i < rows.size(); ++i)
        rows[i]->drafts.push_back(Sampler::argmax(logits_.data() + i * size_t(V), V));
      batch.clear();
      hid.clear();
      rows.clear();
    };
    for (Request& r : reqs) {
      r.drafts.clear();
      auto it = seqs_.find(r.id);
      if (r.k <= 0 || it == seqs_.end()) continue;
      State& st = it->second;
      const std::vector<int32_t>& t = *r.tokens;
      const int64_t n = int64_t(t.size()), have = int64_t(st.hidden.size() / size_t(E_));
      // Pairs (hidden at i, token i + 1) for i = done .. n - 2: the last predicts token n.
      if (st.done + have != n - 1 || have == 0) continue;
      if (st.slot < 0) st.slot = kv_->create_sequence();
      if (st.slot < 0 || !kv_->reserve(st.slot, n - 1)) {
        drop(r.id);
        continue;
      }
      for (int64_t i = st.done; i < n - 1; ++i) {
        if (int(batch.size()) == sizes_.max_batch_tokens || int(rows.size()) == Model::kMaxLogitRows) flush();
        batch.push_back({t[size_t(i + 1)], int32_t(i), int32_t(st.slot), i == n - 2});
        hid.insert(hid.end(), st.hidden.begin() + (i - st.done) * E_, st.hidden.begin() + (i - st.done + 1) * E_);
        if (i == n - 2) rows.push_back(&r);
      }
      st.done = n - 1;
      st.hidden.clear();
    }
    flush();
    int64_t n_drafted = 0;
    for (Request& r : reqs) {
      n_drafted += int64_t(r.drafts.size());
      auto it = seqs_.find(r.id);
      if (it != seqs_.end() && it->second.slot >= 0) kv_->advance(it->second.slot, nullptr, it->second.done);
    }
    account(now_s() - t0, n_drafted);
  }

  void release(int64_t id) override { drop(id); }

 private:
  struct State {
    int slot = -1;
    int64_t done = 0;           // positions whose pair the layer has computed (its cache)
    std::vector<float> hidden;  // the target's hidden states at the next positions, waiting
  };
  void drop(int64_t id) {
    auto it = seqs_.find(id);
    if (it == seqs_.end()) return;
    if (it->second.slot >= 0) kv_->free_sequence(it->second.slot);
    seqs_.erase(it);
  }

  Model& model_;
  DraftModelSizes sizes_;
  std::unique_ptr<KvCache> kv_;
  int64_t E_ = 0;
  std::vector<float> logits_;
  std::unordered_map<int64_t, State> seqs_;
};

}  // namespace

std::unique_ptr<MtpSource> make_mtp(Model& target, Backend& be, const DraftModelSizes& sizes) {
  return std::make_unique<Mtp>(target, be, sizes);
}

std::unique_ptr<DraftSource> make_prompt_lookup(int ngram_min, int ngram_max) {
  TF_CHECK(ngram_min >= 1 && ngram_max >= ngram_min, "prompt lookup: bad n-gram sizes");
  return std::make_unique<PromptLookup>(ngram_min, ngram_max);
}

std::unique_ptr<DraftSource> make_draft_model(const std::string& path, const GgufFile& target, Backend& be,
                                              const DraftModelSizes& sizes) {
  return std::make_unique<DraftModel>(path, target, be, sizes);
}

uint64_t draft_model_bytes(const std::string& path, const DraftModelSizes& z) {
  EngineOptions o;
  o.kv_tokens = z.kv_tokens;
  o.context = z.context;
  o.max_seqs = z.max_seqs;
  o.max_batch_tokens = z.max_batch_tokens;
  o.kv_type = z.kv_type;
  o.prefix_cache = false;
  o.memory_budget = -1;
  try {
    const MemoryPlan p = plan_memory(GgufFile::open(path), o);
    return p.weights + p.kv + p.scratch;
  } catch (const Error& e) {
    fail(e.kind(), "draft model: ", e.what());  // say which of the two files it is about
  }
}

// ---- draft lengths --------------------------------------------------------------------------
void DraftStats::record(int drafted_now, int accepted_now) {
  drafted += drafted_now;
  accepted += accepted_now;
  // Each accepted draft is a success; the first rejected one (if any) a failure. Decayed
  // counts with a weak prior at the old rate: recent steps matter most.
  const double successes = accepted_now, failures = accepted_now < drafted_now ? 1 : 0;
  const double keep = 0.7;
  const double s = keep * rate * 4 + successes, n = keep * 4 + successes + failures;
  rate = std::clamp(s / n, 0.0, 0.99);
  idle_steps = 0;
}

void DraftPolicy::observe_step(int tokens, double seconds) {
  if (tokens <= 0 || !(seconds > 0)) return;
  constexpr double kForget = 0.97;
  w_ = kForget * w_ + 1;
  st_ = kForget * st_ + tokens;
  stt_ = kForget * stt_ + double(tokens) * tokens;
  sy_ = kForget * sy_ + seconds;
  sty_ = kForget * sty_ + tokens * seconds;
}

double DraftPolicy::token_cost() const {
  if (w_ <= 0) return 0;
  const double mean_t = st_ / w_, mean_y = sy_ / w_;
  const double var = stt_ / w_ - mean_t * mean_t;
  // Prior while the step sizes seen do not tell the two apart: c = 6 b.
  const double prior = mean_y / (mean_t + 6);
  if (var < 0.25) return prior;
  const double b = (sty_ / w_ - mean_t * mean_y) / var;
  return std::clamp(b, 0.02 * prior, mean_y / mean_t);
}

double DraftPolicy::fixed_cost() const {
  if (w_ <= 0) return 0;
  return std::max(0.0, sy_ / w_ - token_cost() * st_ / w_);
}

std::vector<int> DraftPolicy::lengths(const std::vector<double>& rate, const std::vector<int>& idle, int batch,
                                      double draft_cost, double catchup_cost) const {
  std::vector<int> k(rate.size(), adaptive_ ? 0 : draft_max_);
  if (!adaptive_) return k;
  const double b = token_cost(), c = fixed_cost();
  // A probe costs a verified token and a draft; a step without drafts c + b * batch.
  const double step = c + b * batch;
  const double probe_every =
      step > 0 ? std::max<double>(kProbeEvery, (b + draft_cost) / (kProbeShare * step)) : double(kProbeEvery);
  const bool probes = !(step > 0) || catchup_cost < kProbeShare * step;
  for (size_t i = 0; i < rate.size(); ++i)
    if (probes && idle[i] >= probe_every) k[i] = 1;
  if (b <= 0) {  // no step measured yet: draft at the prior rate
    for (size_t i = 0; i < rate.size(); ++i) k[i] = std::max(k[i], std::min(draft_max_, 4));
    return k;
  }
  // Candidates: the j-th draft of sequence i is worth rate_i^j tokens; take them in order of
  // worth while the step's expected tokens per second rises.
  struct Cand {
    double worth;
    size_t seq;
  };
  std::vector<Cand> cands;
  for (size_t i = 0; i < rate.size(); ++i) {
    double w = 1;
    for (int j = 1; j <= draft_max_; ++j) {
      w *= rate[i];
      cands.push_back({w, i});
    }
  }
  std::stable_sort(cands.begin(), cands.end(), [](const Cand& x, const Cand& y) { return x.worth > y.worth; });
  double tokens = batch, seconds = c + b * batch;
  for (size_t i = 0; i < k.size(); ++i)
    if (k[i]) tokens += rate[i], seconds += b + draft_cost;
  const double cost = b + draft_cost;
  std::vector<int> taken(rate.size(), 0);
  for (const Cand& cd : cands) {
    ++taken[cd.seq];
    if (taken[cd.seq] <= k[cd.seq]) continue;  // a probe's first draft, already counted
    if (cd.worth * seconds <= cost * tokens) break;
    tokens += cd.worth;
    seconds += cost;
    k[cd.seq] = taken[cd.seq];
  }
  return k;
}

}  // namespace tf
