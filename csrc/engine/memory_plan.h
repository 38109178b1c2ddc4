// The memory plan of one engine rank, computed before anything is allocated: the weights this
// rank keeps resident, the KV pool, activation scratch and logits, communication buffers and a
// safety margin, against a budget. On unified-memory machines running out of memory freezes
// the machine rather than failing a process, so an engine whose plan exceeds the budget is
// refused with the plan and the largest KV pool that would fit. Every allocation of the plan
// is pre-faulted at start-up, so the process's resident memory is the plan from the start and
// does not grow while serving.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gguf/gguf_reader.h"
#include "engine/speculative.h"
#include "kv/kv_cache.h"
#include "model/model_config.h"

namespace tf {

struct EngineOptions;

constexpr int kKvBlockSize = 16;   // positions per KV block
constexpr int kMaxLogitRows = 64;  // logits rows one step may produce (= max sequences per step)

struct MemoryPlan {
  int tp_size = 1, tp_rank = 0;
  int64_t context = 0, kv_tokens = 0;
  int max_batch_tokens = 0;
  uint64_t kv_bytes_per_token = 0;  // cache rows of one token, all layers (compressed groups: per token)
  uint64_t weights = 0;  // resident on this rank
  uint64_t kv = 0;       // KV pool (every group), with the prefix cache's index of its blocks
  uint64_t index_bytes_per_block = 0;  // that index, per block of the first group (0: no prefix cache)
  std::vector<KvGroupPlan> kv_groups;  // a line each: the layers sharing one KvSpec
  uint64_t scratch = 0;  // activations of one step, logits
  uint64_t comm = 0;     // TP transport buffers
  uint64_t draft = 0;    // a draft model: its weights, KV pool and scratch (speculative decoding)
  uint64_t margin = 0;   // safety: allocator slack, thread stacks, the runtime around the engine
  uint64_t budget = 0;   // 0: no budget known
  std::string budget_source;  // "--memory-budget", "available memory", ...
  int64_t max_kv_tokens = 0;  // the largest pool (whole blocks, >= context) within the budget; 0: none
  // When no pool of one full context fits (max_kv_tokens == 0): the largest context that fits
  // with a pool of just that context (kv_tokens = context, whole blocks); 0: none, or not needed.
  int64_t max_context = 0;
  int64_t n_ctx_train = 0;  // the model's trained context (its context_length)

  uint64_t total() const { return weights + kv + scratch + comm + draft + margin; }
  bool fits() const { return budget == 0 || total() <= budget; }
  std::string table() const;
};

class Model;

// The engine's sizes for a model and its options: the per-sequence context, the KV pool (whole
// blocks) and the step's token budget, resolved from the defaults where the options leave 0.
struct EngineGeometry {
  int64_t context = 0, kv_tokens = 0;
  int max_batch_tokens = 0;
};
EngineGeometry resolve_geometry(const ModelConfig& c, const EngineOptions& opts);

// The plan of `model` (its rank's bytes: a plan-only model is enough) with `g`, against the
// budget opts.memory_budget (bytes; 0: available memory; < 0: none).
MemoryPlan plan_memory(Model& model, const EngineGeometry& g, const EngineOptions& opts);
// The same from the file alone (tensorfold plan): reads only its header and tensor table.
MemoryPlan plan_memory(const std::shared_ptr<GgufFile>& file, const EngineOptions& opts);

// The sizes of a draft model's cache and scratch: the target's (EngineOptions::draft).
DraftModelSizes draft_sizes(const EngineOptions& opts, const EngineGeometry& g);

// Bytes of memory this process may still use: MemAvailable, capped by a cgroup limit.
uint64_t available_memory_bytes();

}  // namespace tf
