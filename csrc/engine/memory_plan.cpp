#include "engine/memory_plan.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "core/error.h"
#include "engine/engine.h"
#include "kv/prefix_cache.h"
#include "backend/backend.h"
#include "model/model.h"

namespace tf {

namespace {
// A size in the unit that shows it: GiB from 1 GiB, MiB from 1 MiB, KiB from 1 KiB, else bytes.
std::string human(uint64_t b) {
  char buf[32];
  const double d = double(b);
  if (b >= (uint64_t(1) << 30))
    std::snprintf(buf, sizeof buf, "%.2f GiB", d / double(uint64_t(1) << 30));
  else if (b >= (uint64_t(1) << 20))
    std::snprintf(buf, sizeof buf, "%.1f MiB", d / double(uint64_t(1) << 20));
  else if (b >= 1024)
    std::snprintf(buf, sizeof buf, "%.1f KiB", d / 1024.0);
  else
    std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(b));
  return buf;
}

// A cgroup (v2, then v1) limit minus what the group already uses; 0 when none.
uint64_t cgroup_room() {
  auto read_u64 = [](const char* path, uint64_t& v) {
    std::ifstream f(path);
    std::string s;
    if (!(f >> s) || s == "max") return false;
    char* end = nullptr;
    v = std::strtoull(s.c_str(), &end, 10);
    return end && *end == '\0' && v > 0;
  };
  uint64_t limit = 0, used = 0;
  if (read_u64("/sys/fs/cgroup/memory.max", limit)) {
    read_u64("/sys/fs/cgroup/memory.current", used);
  } else if (read_u64("/sys/fs/cgroup/memory/memory.limit_in_bytes", limit) && limit < (uint64_t(1) << 60)) {
    read_u64("/sys/fs/cgroup/memory/memory.usage_in_bytes", used);
  } else {
    return 0;
  }
  return limit > used ? limit - used : 1;
}
}  // namespace

uint64_t available_memory_bytes() {
  uint64_t avail = 0;
  std::ifstream f("/proc/meminfo");
  std::string key;
  uint64_t kb = 0;
  std::string unit;
  while (f >> key >> kb >> unit)
    if (key == "MemAvailable:") {
      avail = kb * 1024;
      break;
    }
  const uint64_t room = cgroup_room();
  if (room > 0 && (avail == 0 || room < avail)) avail = room;
  return avail;
}

EngineGeometry resolve_geometry(const ModelConfig& c, const EngineOptions& opts) {
  EngineGeometry g;
  g.context = opts.context > 0 ? opts.context : std::min<int64_t>(c.n_ctx_train > 0 ? c.n_ctx_train : 4096, 8192);
  TF_CHECK(g.context >= 2 && g.context <= Engine::kMaxContext, "context must be an integer in [2, ",
           Engine::kMaxContext, "], got ", g.context);
  const int64_t kv_tokens = opts.kv_tokens > 0 ? opts.kv_tokens : std::max<int64_t>(g.context, 4096);
  if (kv_tokens < g.context)
    fail(ErrorKind::InvalidInput, "kv_tokens=", kv_tokens, " must be at least the context (context=", g.context,
         ") so that one full-length sequence fits; raise kv_tokens or lower context");
  g.kv_tokens = (kv_tokens + kKvBlockSize - 1) / kKvBlockSize * kKvBlockSize;
  // A bigger step budget only costs scratch memory: no step needs more than the context.
  g.max_batch_tokens =
      int(std::min<int64_t>({int64_t(opts.max_batch_tokens), int64_t(Engine::kMaxBatchTokens), g.context}));
  return g;
}

namespace {
// Every line of the plan but the budget, for geometry `g`.
void size_plan(MemoryPlan& p, Model& model, const EngineGeometry& g, const EngineOptions& opts) {
  const ModelConfig& c = model.config();
  p.context = g.context;
  p.kv_tokens = g.kv_tokens;
  p.max_batch_tokens = g.max_batch_tokens;
  // The prefix cache's index (rank 0 only: a follower caches nothing) grows with the pool.
  const bool index = opts.prefix_cache && opts.tp.rank == 0;
  p.kv_groups = KvCache::plan(model.kv_specs(), KvSizing{g.kv_tokens, opts.max_seqs, g.max_batch_tokens},
                              opts.kv_type, index);
  p.kv = 0;
  p.kv_bytes_per_token = 0;
  for (const KvGroupPlan& grp : p.kv_groups) {
    p.kv += grp.bytes + grp.index_bytes;
    p.kv_bytes_per_token += grp.bytes_per_token;
  }
  p.index_bytes_per_block = index ? PrefixCache::bytes_per_block(kKvBlockSize) : 0;
  const uint64_t logits = uint64_t(kMaxLogitRows) * uint64_t(c.n_vocab) * sizeof(float);
  const double scratch = model.reserve(g.max_batch_tokens, g.context, /*count_only=*/true);
  p.scratch = (scratch > 1.8e19 ? ~uint64_t(0) / 4 : uint64_t(scratch)) + logits;
  p.comm = 0;
  if (p.tp_size > 1)  // send/receive buffers of the All-Reduce (per rail) and the logits broadcast
    p.comm = 4 * uint64_t(g.max_batch_tokens) * uint64_t(c.n_embd) * sizeof(float) + logits;
  // Allocator slack, thread stacks and the runtime around the engine: 2% of the large
  // allocations, at least 256 MiB.
  p.margin = std::max<uint64_t>(uint64_t(256) << 20, (p.weights + p.kv) / 50);
}

// The geometry of a context of `ctx` tokens with a pool of just that context.
EngineGeometry geometry_for(int64_t ctx, const EngineOptions& opts) {
  EngineGeometry g;
  g.context = ctx;
  g.kv_tokens = (ctx + kKvBlockSize - 1) / kKvBlockSize * kKvBlockSize;
  g.max_batch_tokens = int(std::min<int64_t>({int64_t(opts.max_batch_tokens), int64_t(Engine::kMaxBatchTokens), ctx}));
  return g;
}
}  // namespace

DraftModelSizes draft_sizes(const EngineOptions& opts, const EngineGeometry& g) {
  DraftModelSizes z;
  z.kv_tokens = g.kv_tokens;
  z.context = g.context;
  z.max_seqs = opts.max_seqs;
  z.max_batch_tokens = g.max_batch_tokens;
  z.kv_type = opts.kv_type;
  return z;
}

MemoryPlan plan_memory(Model& model, const EngineGeometry& g, const EngineOptions& opts) {
  MemoryPlan p;
  p.tp_size = opts.tp.size;
  p.tp_rank = opts.tp.rank;
  p.n_ctx_train = model.config().n_ctx_train;
  p.weights = model.weight_bytes();
  size_plan(p, model, g, opts);
  // A draft model lives on rank 0 beside the target (prompt lookup needs no memory).
  if (!opts.draft.empty() && opts.draft != "lookup" && opts.draft != "mtp" && opts.tp.rank == 0)
    p.draft = draft_model_bytes(opts.draft, draft_sizes(opts, g));
  // MTP: its weights are the model's; its own cache and the hidden states it reads are not.
  if (opts.draft == "mtp" && model.config().n_nextn > 0 && opts.tp.rank == 0) {
    const DraftModelSizes z = draft_sizes(opts, g);
    for (const KvGroupPlan& grp :
         KvCache::plan(model.nextn_kv_specs(0), KvSizing{z.kv_tokens, z.max_seqs, z.max_batch_tokens}, opts.kv_type, false))
      p.draft += grp.bytes;
    p.draft += uint64_t(g.max_batch_tokens) * uint64_t(model.hidden_width()) * sizeof(float);
  }
  if (opts.memory_budget > 0) {
    p.budget = uint64_t(opts.memory_budget);
    p.budget_source = "memory_budget";
  } else if (opts.memory_budget == 0) {
    p.budget = available_memory_bytes();
    p.budget_source = "available memory";
  }
  if (p.budget > 0) {
    const uint64_t fixed = p.weights + p.scratch + p.comm + p.draft + p.margin;
    if (p.budget > fixed && p.kv > 0) {
      // Every group sized by tokens grows in proportion to the pool (its bytes per token of the
      // pool, in whole blocks of kKvBlockSize tokens); groups sized by sequences stay.
      double per_seqs = 0;
      for (const KvGroupPlan& grp : p.kv_groups)
        if (grp.seq_tokens > 0) per_seqs += double(grp.bytes + grp.index_bytes);
      const double per_token = (double(p.kv) - per_seqs) / double(g.kv_tokens);
      const double room = double(p.budget - fixed) - per_seqs;
      const int64_t tokens =
          room <= 0 ? 0
          : per_token <= 0 ? Engine::kMaxKvTokens / kKvBlockSize * kKvBlockSize
                           : int64_t(std::min(room / per_token, double(Engine::kMaxKvTokens))) / kKvBlockSize * kKvBlockSize;
      int64_t fit = tokens;
      // Rounding of compressed groups to whole blocks: step down until the plan really fits.
      while (fit >= g.context) {
        MemoryPlan q = p;
        EngineGeometry gg = g;
        gg.kv_tokens = fit;
        size_plan(q, model, gg, opts);
        if (q.total() <= p.budget) break;
        fit -= kKvBlockSize;
      }
      p.max_kv_tokens = fit >= g.context ? fit : 0;
    }
    if (p.max_kv_tokens == 0) {
      // No pool of one full context fits: the largest context that does (with a pool of just
      // that context). Every line grows with the context, so a bisection finds it.
      auto fits = [&](int64_t ctx) {
        MemoryPlan q = p;
        size_plan(q, model, geometry_for(ctx, opts), opts);
        return q.total() <= p.budget;
      };
      int64_t lo = 2, hi = g.context - 1;  // g.context itself does not fit
      if (hi >= lo && fits(lo)) {
        while (lo < hi) {
          const int64_t mid = lo + (hi - lo + 1) / 2;
          if (fits(mid))
            lo = mid;
          else
            hi = mid - 1;
        }
        p.max_context = lo;
      }
    }
  }
  return p;
}

MemoryPlan plan_memory(const std::shared_ptr<GgufFile>& file, const EngineOptions& opts) {
  TpShard shard;
  shard.size = opts.tp.size;
  shard.rank = opts.tp.rank;
  shard.plan_only = true;
  std::unique_ptr<Backend> be = make_backend(BackendOptions{"cpu", 1, ""});  // sizes the products' working memory
  Model model(file, be.get(), shard);
  return plan_memory(model, resolve_geometry(model.config(), opts), opts);
}

std::string MemoryPlan::table() const {
  std::ostringstream os;
  auto row = [&](const char* what, uint64_t b, const std::string& note) {
    char buf[200];
    std::snprintf(buf, sizeof buf, "  %-22s %12s%s%s\n", what, human(b).c_str(), note.empty() ? "" : "   ",
                  note.c_str());
    os << buf;
  };
  os << "memory plan (TP rank " << tp_rank << " of " << tp_size << "):\n";
  row("weights (this rank)", weights, tp_size > 1 ? "this rank's slices" : "the mapped file, pre-faulted");
  if (kv_groups.size() <= 1) {
    row("KV cache pool", kv,
        std::to_string(kv_tokens) + " tokens x " + std::to_string(kv_bytes_per_token) + " bytes" +
            (index_bytes_per_block ? " + prefix-cache index" : ""));
  } else {
    for (size_t i = 0; i < kv_groups.size(); ++i) {
      const KvGroupPlan& g = kv_groups[i];
      const std::string what = "KV group " + std::to_string(i);
      row(what.c_str(), g.bytes + g.index_bytes,
          std::to_string(g.layers.size()) + (g.layers.size() == 1 ? " layer: " : " layers: ") + g.spec.describe() +
              (g.seq_tokens > 0 ? "; " + human(g.bytes_per_seq) + " per sequence" : "") +
              (g.index_bytes ? "; + prefix-cache index" : ""));
    }
  }
  row("scratch + logits", scratch, std::to_string(max_batch_tokens) + " tokens per step");
  row("comm buffers", comm, tp_size > 1 ? "All-Reduce and logits" : "none (TP=1)");
  if (draft) row("speculative draft", draft, "draft model weights + KV + scratch, or MTP KV + hidden states");
  row("safety margin", margin, "allocator, stacks, runtime");
  row("total", total(), "");
  if (budget > 0) {
    row("budget", budget, budget_source);
    os << (fits() ? "  fits" : "  DOES NOT FIT");
    if (max_kv_tokens > 0) {
      os << "; the largest KV pool within the budget: kv_tokens=" << max_kv_tokens;
    } else {
      os << "; no KV pool of at least one full context (" << context << " tokens) fits";
      if (max_context > 0)
        os << "; the largest context that fits: context=" << max_context << " with kv_tokens="
           << (max_context + kKvBlockSize - 1) / kKvBlockSize * kKvBlockSize;
      else
        os << "; not even a context of 2 tokens fits (the weights, scratch and margin alone exceed the budget)";
    }
    os << "\n";
  } else {
    os << "  no budget\n";
  }
  return os.str();
}

}  // namespace tf
