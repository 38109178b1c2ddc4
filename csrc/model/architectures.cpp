// The architecture table: one row per general.architecture a GGUF may name, saying which
// block kinds its layers use and the few switches between them. A new architecture is a row
// here (plus a block file, only if it needs a kind the model lacks: model/kinds.cpp).
#include "model/model_config.h"

namespace tf {

namespace {
const ArchTraits kArchitectures[] = {
    // name       covers            attention           rope_neox qkv_bias qk_norm norm_topk sliding_window
    {"llama",     "incl. mixtral",  AttentionKind::Gqa, false,    false,   false,  true,     true},
    {"qwen2",     "",               AttentionKind::Gqa, true,     true,    false,  false,    true},
    {"qwen2moe",  "",               AttentionKind::Gqa, true,     true,    false,  false,    false},
    {"qwen3",     "",               AttentionKind::Gqa, true,     false,   true,   false,    false},
    {"qwen3moe",  "",               AttentionKind::Gqa, true,     false,   true,   true,     false},
    {"deepseek2", "DeepSeek V2/V3/R1, Kimi-K2, Moonlight",
                                    AttentionKind::Mla, false,    false,   false,  false,    false},
    // V4: layers of the three SharedKv kinds by attention.compress_ratios, hyper-connections
    {"deepseek4", "DeepSeek V4", AttentionKind::SharedKvWindow, false, false, false, true, false},
};
}  // namespace

const char* attention_kind_name(AttentionKind k) {
  switch (k) {
    case AttentionKind::Gqa: return "gqa";
    case AttentionKind::Mla: return "mla";
    case AttentionKind::Swa: return "swa";
    case AttentionKind::SharedKvWindow: return "shared-kv window";
    case AttentionKind::SharedKvCompressed: return "shared-kv window + compressed";
    case AttentionKind::SharedKvSparse: return "shared-kv window + sparse compressed";
  }
  return "?";
}

const ArchTraits* find_arch(const std::string& name) {
  for (const ArchTraits& a : kArchitectures)
    if (name == a.name) return &a;
  return nullptr;
}

std::string supported_arch_names() {
  std::string out;
  for (const ArchTraits& a : kArchitectures) {
    if (!out.empty()) out += ", ";
    out += a.name;
    if (*a.covers) out += std::string(" (") + a.covers + ")";
  }
  return out;
}

}  // namespace tf
