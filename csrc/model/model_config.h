// A decoder architecture described as data, read from GGUF metadata. Every supported
// family (llama, qwen2, qwen3 dense) is one forward pass with these switches.
#pragma once
#include <cstdint>
#include <string>

#include "gguf/gguf_reader.h"

namespace tf {

struct ModelConfig {
  std::string arch;          // general.architecture
  std::string name;          // general.name
  int n_embd = 0;
  int n_layer = 0;
  int n_head = 0;
  int n_head_kv = 0;
  int head_dim = 0;          // per head, for q/k/v
  int n_ff = 0;
  int64_t n_vocab = 0;
  int64_t n_ctx_train = 0;
  float rms_eps = 1e-6f;
  float rope_base = 10000.f;
  float rope_freq_scale = 1.f;  // 1 / linear scaling factor
  int rope_dim = 0;
  bool rope_neox = false;    // rotate halves (NeoX) instead of adjacent pairs
  bool qkv_bias = false;     // qwen2
  bool qk_norm = false;      // qwen3: RMSNorm over each q/k head
  bool tied_output = false;  // LM head shares token_embd

  static ModelConfig from_gguf(const GgufFile& f);
  std::string summary() const;
};

}  // namespace tf
