#include "engine/memory_plan.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "core/error.h"
#include "engine/engine.h"
#include "kv/prefix_cache.h"
#include "model/llama_model.h"

namespace tf {

namespace {
std::string gib(uint64_t b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", double(b) / double(uint64_t(1) << 30));
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
  TF_CHECK(g.context >= 2 && g.context <= Engine::kMaxContext, "context = ", g.context, " is out of range (2..",
           Engine::kMaxContext, ")");
  const int64_t kv_tokens = opts.kv_tokens > 0 ? opts.kv_tokens : std::max<int64_t>(g.context, 4096);
  if (kv_tokens < g.context)
    fail(ErrorKind::InvalidInput, "kv_tokens (", kv_tokens, ") must be at least the context (", g.context,
         ") so that one full-length sequence fits; raise kv_tokens or lower context");
  g.kv_tokens = (kv_tokens + kKvBlockSize - 1) / kKvBlockSize * kKvBlockSize;
  // A bigger step budget only costs scratch memory: no step needs more than the context.
  g.max_batch_tokens =
      int(std::min<int64_t>({int64_t(opts.max_batch_tokens), int64_t(Engine::kMaxBatchTokens), g.context}));
  return g;
}

MemoryPlan plan_memory(LlamaModel& model, const EngineGeometry& g, const EngineOptions& opts) {
  const ModelConfig& c = model.config();
  MemoryPlan p;
  p.tp_size = opts.tp.size;
  p.tp_rank = opts.tp.rank;
  p.context = g.context;
  p.kv_tokens = g.kv_tokens;
  p.max_batch_tokens = g.max_batch_tokens;
  p.kv_bytes_per_token = PagedKvCache::bytes_per_token(c.n_layer, model.kv_layout(), opts.kv_type);
  p.weights = model.weight_bytes();
  // The prefix cache's index (rank 0 only: a follower caches nothing) grows with the pool.
  if (opts.prefix_cache && opts.tp.rank == 0) p.index_bytes_per_block = PrefixCache::bytes_per_block(kKvBlockSize);
  p.kv = p.kv_bytes_per_token * uint64_t(g.kv_tokens) + p.index_bytes_per_block * uint64_t(g.kv_tokens / kKvBlockSize);
  const uint64_t logits = uint64_t(kMaxLogitRows) * uint64_t(c.n_vocab) * sizeof(float);
  p.scratch = model.reserve(g.max_batch_tokens, g.context, 1, /*count_only=*/true) + logits;
  if (p.tp_size > 1)  // send/receive buffers of the All-Reduce (per rail) and the logits broadcast
    p.comm = 4 * uint64_t(g.max_batch_tokens) * uint64_t(c.n_embd) * sizeof(float) + logits;
  // Allocator slack, thread stacks and the runtime around the engine: 2% of the large
  // allocations, at least 256 MiB.
  p.margin = std::max<uint64_t>(uint64_t(256) << 20, (p.weights + p.kv) / 50);
  if (opts.memory_budget > 0) {
    p.budget = uint64_t(opts.memory_budget);
    p.budget_source = "memory_budget";
  } else if (opts.memory_budget == 0) {
    p.budget = available_memory_bytes();
    p.budget_source = "available memory";
  }
  if (p.budget > 0) {
    const uint64_t fixed = p.weights + p.scratch + p.comm + p.margin;
    if (p.budget > fixed && p.kv_bytes_per_token > 0) {
      const uint64_t per_block = p.kv_bytes_per_token * kKvBlockSize + p.index_bytes_per_block;
      const int64_t tokens = int64_t((p.budget - fixed) / per_block) * kKvBlockSize;
      p.max_kv_tokens = tokens >= g.context ? tokens : 0;
    }
  }
  return p;
}

MemoryPlan plan_memory(const std::shared_ptr<GgufFile>& file, const EngineOptions& opts) {
  TpShard shard;
  shard.size = opts.tp.size;
  shard.rank = opts.tp.rank;
  shard.plan_only = true;
  LlamaModel model(file, shard);
  return plan_memory(model, resolve_geometry(model.config(), opts), opts);
}

std::string MemoryPlan::table() const {
  std::ostringstream os;
  auto row = [&](const char* what, uint64_t b, const std::string& note) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "  %-22s %12s   %s\n", what, gib(b).c_str(), note.c_str());
    os << buf;
  };
  os << "memory plan (TP rank " << tp_rank << " of " << tp_size << "):\n";
  row("weights (this rank)", weights, tp_size > 1 ? "this rank's slices" : "the mapped file, pre-faulted");
  row("KV cache pool", kv,
      std::to_string(kv_tokens) + " tokens x " + std::to_string(kv_bytes_per_token) + " bytes" +
          (index_bytes_per_block ? " + prefix-cache index" : ""));
  row("scratch + logits", scratch, std::to_string(max_batch_tokens) + " tokens per step");
  row("comm buffers", comm, tp_size > 1 ? "All-Reduce and logits" : "none (TP=1)");
  row("safety margin", margin, "allocator, stacks, runtime");
  row("total", total(), "");
  if (budget > 0) {
    row("budget", budget, budget_source);
    os << (fits() ? "  fits" : "  DOES NOT FIT");
    if (max_kv_tokens > 0)
      os << "; the largest KV pool within the budget: kv_tokens " << max_kv_tokens;
    else
      os << "; no KV pool of at least one full context (" << context << " tokens) fits";
    os << "\n";
  } else {
    os << "  no budget\n";
  }
  return os.str();
}

}  // namespace tf
