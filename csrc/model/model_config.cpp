#include "model/model_config.h"

#include <sstream>

#include "core/error.h"

namespace tf {

namespace {
int positive_int(const GgufFile& f, const std::string& key, int64_t v, int64_t limit = 1 << 24) {
  if (v <= 0 || v > limit)
    fail(ErrorKind::InvalidInput, f.path(), ": metadata ", key, " = ", v, " is out of range");
  return int(v);
}
}  // namespace

ModelConfig ModelConfig::from_gguf(const GgufFile& f) {
  ModelConfig c;
  c.arch = f.get_string("general.architecture");
  c.name = f.get_string("general.name", "");
  const std::string& a = c.arch;
  bool default_norm_topk = false;
  if (a == "llama") {  // also Mixtral-style llama with experts
    c.rope_neox = false;
    default_norm_topk = true;
  } else if (a == "qwen2" || a == "qwen2moe") {
    c.rope_neox = true;
    c.qkv_bias = true;
  } else if (a == "qwen3" || a == "qwen3moe") {
    c.rope_neox = true;
    c.qk_norm = true;
    default_norm_topk = a == "qwen3moe";
  } else if (a == "deepseek2") {
    fail(ErrorKind::Unsupported, f.path(), ": architecture 'deepseek2' needs multi-head latent attention (MLA), ",
         "which TensorFold does not implement yet (its expert routing is supported)");
  } else {
    fail(ErrorKind::Unsupported, f.path(), ": architecture '", a,
         "' is not supported (supported: llama (incl. mixtral), qwen2, qwen3, qwen2moe, qwen3moe)");
  }
  auto key = [&](const char* k) { return a + "." + k; };
  c.n_embd = positive_int(f, key("embedding_length"), f.get_int(key("embedding_length")));
  c.n_layer = positive_int(f, key("block_count"), f.get_int(key("block_count")), 4096);
  c.n_head = positive_int(f, key("attention.head_count"), f.get_int(key("attention.head_count")), 4096);
  c.n_head_kv = positive_int(f, key("attention.head_count_kv"),
                             f.get_int(key("attention.head_count_kv"), c.n_head), 4096);
  if (c.n_head % c.n_head_kv != 0)
    fail(ErrorKind::InvalidInput, f.path(), ": head_count ", c.n_head,
         " is not a multiple of head_count_kv ", c.n_head_kv);
  const int64_t default_hd = c.n_embd / c.n_head;
  c.head_dim = positive_int(f, key("attention.key_length"), f.get_int(key("attention.key_length"), default_hd), 512);
  const int64_t vdim = f.get_int(key("attention.value_length"), c.head_dim);
  if (vdim != c.head_dim)
    fail(ErrorKind::Unsupported, f.path(), ": value_length != key_length is not supported");
  c.n_expert = int(f.get_int(key("expert_count"), 0));
  if (c.n_expert < 0 || c.n_expert > 4096)
    fail(ErrorKind::InvalidInput, f.path(), ": ", key("expert_count"), " = ", c.n_expert, " is out of range");
  // MoE models may have no dense FFN at all; feed_forward_length then only describes
  // leading dense layers (if any).
  c.n_ff = int(f.get_int(key("feed_forward_length"), 0));
  if (c.n_ff < 0 || (!c.is_moe() && c.n_ff == 0))
    fail(ErrorKind::InvalidInput, f.path(), ": ", key("feed_forward_length"), " is missing or invalid");
  if (c.is_moe()) {
    c.n_expert_used = positive_int(f, key("expert_used_count"), f.get_int(key("expert_used_count")), c.n_expert);
    c.n_ff_exp = int(f.get_int(key("expert_feed_forward_length"), c.n_ff));
    c.n_ff_exp = positive_int(f, key("expert_feed_forward_length"), c.n_ff_exp);
    c.n_ff_shexp = int(f.get_int(key("expert_shared_feed_forward_length"), 0));
    if (c.n_ff_shexp < 0) fail(ErrorKind::InvalidInput, f.path(), ": negative shared expert width");
    c.router.n_expert = c.n_expert;
    c.router.n_used = c.n_expert_used;
    const int64_t gating = f.get_int(key("expert_gating_func"), 1);
    if (gating != 1 && gating != 2)
      fail(ErrorKind::Unsupported, f.path(), ": expert_gating_func ", gating, " is not supported");
    c.router.gating = gating == 2 ? moe::Gating::Sigmoid : moe::Gating::Softmax;
    c.router.norm_topk = f.get_bool(key("expert_weights_norm"), default_norm_topk);
    c.router.scale = float(f.get_float(key("expert_weights_scale"), 1.0));
    c.router.n_group = int(f.get_int(key("expert_group_count"), 1));
    c.router.n_group_used = int(f.get_int(key("expert_group_used_count"), c.router.n_group));
    try {
      moe::validate(c.router);
    } catch (const Error& e) {
      fail(ErrorKind::InvalidInput, f.path(), ": invalid expert routing metadata: ", e.what());
    }
  }
  c.n_ctx_train = f.get_int(key("context_length"), 4096);
  c.rms_eps = float(f.get_float(key("attention.layer_norm_rms_epsilon"), 1e-6));
  c.rope_base = float(f.get_float(key("rope.freq_base"), 10000.0));
  c.rope_dim = positive_int(f, key("rope.dimension_count"), f.get_int(key("rope.dimension_count"), c.head_dim), 4096);
  if (c.rope_dim > c.head_dim || c.rope_dim % 2)
    fail(ErrorKind::InvalidInput, f.path(), ": rope.dimension_count ", c.rope_dim, " is invalid for head_dim ", c.head_dim);
  const std::string scaling = f.get_string(key("rope.scaling.type"), "none");
  if (scaling == "linear") {
    const double factor = f.get_float(key("rope.scaling.factor"), 1.0);
    if (factor <= 0) fail(ErrorKind::InvalidInput, f.path(), ": rope.scaling.factor must be > 0");
    c.rope_freq_scale = float(1.0 / factor);
  } else if (scaling != "none" && scaling != "") {
    fail(ErrorKind::Unsupported, f.path(), ": rope scaling '", scaling, "' is not supported yet");
  }
  if (f.find_tensor("rope_freqs.weight"))
    fail(ErrorKind::Unsupported, f.path(), ": per-dimension rope frequency factors (rope_freqs) are not supported yet");
  const GgufTensorInfo* emb = f.find_tensor("token_embd.weight");
  if (!emb) fail(ErrorKind::InvalidInput, f.path(), ": tensor token_embd.weight is missing");
  if (emb->ne.size() != 2 || emb->ne[0] != c.n_embd)
    fail(ErrorKind::InvalidInput, f.path(), ": token_embd.weight has the wrong shape");
  c.n_vocab = emb->ne[1];
  c.tied_output = f.find_tensor("output.weight") == nullptr;
  return c;
}

std::string ModelConfig::summary() const {
  std::ostringstream os;
  os << arch << " '" << name << "': " << n_layer << " layers, n_embd " << n_embd << ", heads "
     << n_head << "/" << n_head_kv << " x " << head_dim << ", ffn " << n_ff << ", vocab " << n_vocab
     << ", rope " << (rope_neox ? "neox" : "norm") << " base " << rope_base
     << (tied_output ? ", tied output" : "");
  if (is_moe())
    os << ", " << n_expert << " experts (top-" << n_expert_used << ", width " << n_ff_exp << ")"
       << (n_ff_shexp ? ", shared expert" : "");
  return os.str();
}

}  // namespace tf
