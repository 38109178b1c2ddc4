// A decoder architecture described as data, read from GGUF metadata: the architecture's row
// of kArchitectures (model_config.cpp) and the file's hyperparameters.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "gguf/gguf_reader.h"
#include "moe/router.h"

namespace tf {

// The attention block a layer runs (and so the cache entries it keeps), one per layer: the
// architecture's row names the kind of each layer (model/architectures.cpp), and
// model/kinds.cpp makes the block of each kind.
enum class AttentionKind {
  Gqa,  // grouped-query attention: per KV head a K and a V row per position
  Mla,  // multi-head latent attention: one latent + rope-key row per position, absorbed
  Swa,  // grouped-query attention over a sliding window of the last `sliding_window` positions
  // Shared-KV attention: one row per position read as both K and V by every head, attention
  // sinks, a grouped low-rank output projection; every layer reads a sliding window, and
  SharedKvWindow,      // ... only that
  SharedKvCompressed,  // ... also every entry of a compressed cache (one per compress_ratio tokens)
  SharedKvSparse,      // ... also the top entries of a compressed cache a lightning indexer picks
};
const char* attention_kind_name(AttentionKind k);

// What distinguishes an architecture in the forward pass (one row per general.architecture).
struct ArchTraits {
  const char* name;
  const char* covers;              // for error messages: what else the name covers
  AttentionKind attention;         // the kind of every layer (but see sliding_window)
  bool rope_neox;                  // rotate halves (NeoX) instead of adjacent pairs
  bool qkv_bias;                   // q/k/v projections have biases
  bool qk_norm;                    // RMSNorm over each q/k head
  bool norm_topk;                  // default of expert_weights_norm
  // The file's attention.sliding_window (with attention.sliding_window_pattern) makes layers
  // Swa (sliding windows over GQA).
  bool sliding_window;
};
const ArchTraits* find_arch(const std::string& name);

// A rotary embedding: rotated dimensions, base, linear/YaRN scaling (see model/rope.h).
struct RopeSpec {
  int dim = 0;
  float base = 10000.f;
  float freq_scale = 1.f;  // 1 / scaling factor (linear and YaRN)
  // YaRN: dimensions below yarn_low rotate as trained, above yarn_high interpolated by
  // freq_scale, a linear ramp between; cos/sin scaled by mscale.
  bool yarn = false;
  float yarn_low = 0.f, yarn_high = 0.f, yarn_ext_factor = 0.f;
  float mscale = 1.f;
};
// Limits of multi-head latent attention: the cached row (latent + rope key) and the heads
// that read it together (the attention kernel's).
constexpr int kMaxLatentRow = 1024;
constexpr int kMaxMlaHeads = 128;
std::string supported_arch_names();

struct ModelConfig {
  std::string arch;          // general.architecture
  std::string name;          // general.name
  int n_embd = 0;
  int n_layer = 0;
  int n_head = 0;
  int n_head_kv = 0;
  int head_dim = 0;          // per head, for q/k/v (MLA: q and expanded k, nope + rope)
  AttentionKind attention = AttentionKind::Gqa;  // the architecture's kind (MLA geometry when Mla)
  std::vector<AttentionKind> layer_attention;     // the kind of each layer
  int64_t sliding_window = 0;                     // Swa layers: positions each token reads
  // Multi-head latent attention. q = W_q x, or W_qb norm(W_qa x) with a q-LoRA
  // (q_lora_rank > 0); per token one latent c = norm(W_kva x)[:kv_lora_rank] and one rope key
  // shared by all heads; head h's key/value are W_kb[h] c (qk_nope values, then the rope key)
  // and W_vb[h] c (v_head_dim values).
  int q_lora_rank = 0;
  int kv_lora_rank = 0;
  int qk_nope_dim = 0;       // = head_dim - rope_dim
  int v_head_dim = 0;        // per head, after W_vb
  // Softmax scale of q.k: 1/sqrt(head_dim), times the YaRN mscale^2 of MLA models.
  float attn_scale = 1.f;
  int n_ff = 0;
  int64_t n_vocab = 0;
  int64_t n_ctx_train = 0;
  float rms_eps = 1e-6f;
  float rope_base = 10000.f;
  float rope_freq_scale = 1.f;  // 1 / scaling factor (linear and YaRN)
  // YaRN (rope.scaling.type "yarn"): dimensions below yarn_low rotate as trained
  // (extrapolated), above yarn_high interpolated by rope_freq_scale, a linear ramp between;
  // cos/sin scaled by rope_mscale. Both set from the file's keys at load (see rope.cpp).
  bool rope_yarn = false;
  float yarn_low = 0.f, yarn_high = 0.f, yarn_ext_factor = 0.f;
  float rope_mscale = 1.f;
  int rope_dim = 0;
  bool rope_neox = false;    // rotate halves (NeoX) instead of adjacent pairs
  bool qkv_bias = false;     // Q/K/V projections with biases
  bool qk_norm = false;      // RMSNorm over each q/k head
  bool tied_output = false;  // LM head shares token_embd
  int n_nextn = 0;           // next-token-prediction layers after the n_layer ordinary ones

  // Shared-KV attention (AttentionKind::SharedKv*): per layer the compression ratio of its
  // compressed cache (0: window only); the compressed branches' rope (own base, the file's YaRN;
  // the window-only layers use the plain rope at rope_base); the grouped output projection
  // (o_groups groups of heads, each to o_lora_rank values); the lightning indexer.
  std::vector<int> compress_ratio;
  RopeSpec compress_rope;
  int o_groups = 0, o_lora_rank = 0;
  int index_heads = 0, index_dim = 0, index_topk = 0;
  // Hyper-connections: hc_mult residual streams mixed around every block (1: one stream).
  int hc_mult = 1, hc_sinkhorn_iters = 0;
  float hc_eps = 0.f;
  // MoE: the first hash_layers layers route by a token -> experts table; SwiGLU clamped at a
  // per-layer limit for routed and shared experts (0: none).
  int hash_layers = 0;
  std::vector<float> swiglu_limit, swiglu_limit_shexp;

  // Mixture of experts (n_expert == 0: dense). Which layers are MoE is decided per layer by
  // the presence of its router tensor (leading dense layers have none).
  int n_expert = 0;
  int n_expert_used = 0;
  int n_ff_exp = 0;          // expert FFN width
  int n_ff_shexp = 0;        // shared expert FFN width (0: none)
  bool shared_expert_gate = false;  // shared expert scaled by sigmoid(x . w)
  moe::RouterConfig router;  // gating, top-k, normalisation, scale, groups

  bool is_moe() const { return n_expert > 0; }

  static ModelConfig from_gguf(const GgufFile& f);
  // The shared-KV attention, hyper-connection and routing keys (model/config_shared_kv.cpp).
  void read_shared_kv(const GgufFile& f);
  RopeSpec rope() const;  // the main rope
  std::string summary() const;
};

}  // namespace tf
