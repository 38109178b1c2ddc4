#include "model/model_config.h"

#include <cmath>
#include <limits>
#include <sstream>

#include "core/error.h"
#include "model/metadata.h"
#include "model/rope.h"

namespace tf {

// Integer metadata is range-checked as int64 before it is narrowed, so 2^32 + 1536 is refused,
// not read as 1536.
int64_t int_in(const GgufFile& f, const std::string& key, int64_t v, int64_t lo, int64_t hi) {
  if (v < lo || v > hi)
    fail(ErrorKind::InvalidInput, f.display_path(), ": metadata ", key, " = ", v,
         " is out of range (valid: ", lo, "..", hi, ")");
  return v;
}

int int_key(const GgufFile& f, const std::string& key, int64_t lo, int64_t hi) {
  return int(int_in(f, key, f.get_int(key), lo, hi));
}

int int_key(const GgufFile& f, const std::string& key, int64_t def, int64_t lo, int64_t hi) {
  return int(int_in(f, key, f.get_int(key, def), lo, hi));
}

// Float metadata must be finite and inside [lo, hi] (also after narrowing to float: 1e-300
// would become 0).
float float_key(const GgufFile& f, const std::string& key, double def, double lo, double hi) {
  const double v = f.get_float(key, def);
  const float n = float(v);
  if (!std::isfinite(v) || v < lo || v > hi || !std::isfinite(n) || (lo > 0 && n <= 0.f)) {
    std::ostringstream os;
    os << f.display_path() << ": metadata " << key << " = " << v << " is out of range (valid: a finite value in ";
    if (lo > 0 && lo < 1e-30) os << "(0, " << hi << "]";
    else os << "[" << lo << ", " << hi << "]";
    os << ")";
    throw Error(ErrorKind::InvalidInput, os.str());
  }
  return n;
}

// A name read from the file, made safe to print: bytes that are not printable ASCII escaped.
std::string printable(const std::string& s) {
  std::string out;
  static const char hex[] = "0123456789abcdef";
  for (unsigned char c : s) {
    if (out.size() > 200) { out += "..."; break; }
    if (c >= 0x20 && c < 0x7f) {
      out += char(c);
    } else {
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  return out;
}

namespace {

// Valid UTF-8 stays as it is; anything else gets each bad byte replaced by U+FFFD, so the
// string can always become a Python str.
std::string utf8_or_replace(const std::string& s) {
  std::string out;
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    unsigned c = p[i];
    size_t len = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
    bool ok = len > 0 && n - i >= len;
    uint32_t cp = len == 1 ? c : len == 2 ? (c & 0x1F) : len == 3 ? (c & 0x0F) : (c & 0x07);
    for (size_t k = 1; ok && k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) ok = false;
      else cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    static const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (ok && (cp < min_cp[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))) ok = false;
    if (ok) {
      out.append(s, i, len);
      i += len;
    } else {
      out += "\xEF\xBF\xBD";
      ++i;
    }
  }
  return out;
}

// Multi-head latent attention's sizes. llama.cpp's current files (attn_k_b/attn_v_b) give the cached
// row as key_length/value_length (latent + rope / latent) and the per-head sizes as the *_mla
// keys; older files (attn_kv_b) have only key_length/value_length, then per head.
void read_mla_geometry(const GgufFile& f, ModelConfig& c) {
  const std::string& path = f.display_path();
  auto key = [&](const char* k) { return c.arch + "." + k; };
  c.kv_lora_rank = int_key(f, key("attention.kv_lora_rank"), 1, kMaxLatentRow);
  const bool split = f.get_int(key("attention.key_length_mla"), -1) != -1;
  c.head_dim = int_key(f, key(split ? "attention.key_length_mla" : "attention.key_length"), 2, 4096);
  c.v_head_dim = int_key(f, key(split ? "attention.value_length_mla" : "attention.value_length"), c.head_dim, 1, 4096);
  // q-LoRA: from its key, or (files that omit it, as V2-Lite's do) from the tensor itself.
  int64_t q_lora = f.get_int(key("attention.q_lora_rank"), 0);
  const GgufTensorInfo* qa = f.find_tensor("blk.0.attn_q_a.weight");
  if (q_lora == 0 && qa && qa->ne.size() == 2) q_lora = qa->ne[1];
  c.q_lora_rank = int(int_in(f, key("attention.q_lora_rank"), q_lora, 0, 1 << 16));
  if (c.n_head > kMaxMlaHeads)
    fail(ErrorKind::Unsupported, path, ": ", c.n_head, " attention heads; multi-head latent attention supports at most ",
         kMaxMlaHeads);
  c.n_head_kv = 1;  // every head reads the one latent row
}

}  // namespace

ModelConfig ModelConfig::from_gguf(const GgufFile& f) {
  ModelConfig c;
  const std::string& path = f.display_path();
  c.arch = f.get_string("general.architecture");
  c.name = utf8_or_replace(f.get_string("general.name", ""));  // display only
  const std::string& a = c.arch;
  const ArchTraits* traits = find_arch(a);
  if (!traits)
    fail(ErrorKind::Unsupported, path, ": architecture '", printable(a),
         "' (general.architecture) is not supported (supported: ", supported_arch_names(), ")");
  c.rope_neox = traits->rope_neox;
  c.qkv_bias = traits->qkv_bias;
  c.qk_norm = traits->qk_norm;
  const bool default_norm_topk = traits->norm_topk;
  auto key = [&](const char* k) { return a + "." + k; };
  c.n_embd = int_key(f, key("embedding_length"), 1, 1 << 24);
  c.n_layer = int_key(f, key("block_count"), 1, 4096);
  // Next-token-prediction layers follow the ordinary ones and count in block_count.
  c.n_nextn = int_key(f, key("nextn_predict_layers"), 0, 0, c.n_layer - 1);
  c.n_layer -= c.n_nextn;
  c.n_head = int_key(f, key("attention.head_count"), 1, 4096);
  c.n_head_kv = int_key(f, key("attention.head_count_kv"), c.n_head, 1, 4096);
  if (c.n_head % c.n_head_kv != 0)
    fail(ErrorKind::InvalidInput, path, ": head_count ", c.n_head,
         " is not a multiple of head_count_kv ", c.n_head_kv);
  const int64_t default_hd = c.n_embd / c.n_head;
  c.attention = traits->attention;
  if (c.attention != AttentionKind::Mla) {
    c.head_dim = int_key(f, key("attention.key_length"), default_hd, 1, 512);
    const int64_t vdim = f.get_int(key("attention.value_length"), c.head_dim);
    if (vdim != c.head_dim)
      fail(ErrorKind::Unsupported, path, ": value_length != key_length is not supported");
  } else {
    read_mla_geometry(f, c);
  }
  c.n_expert = int_key(f, key("expert_count"), 0, 0, 4096);
  // MoE models may have no dense FFN at all; feed_forward_length then only describes
  // leading dense layers (if any).
  c.n_ff = int_key(f, key("feed_forward_length"), 0, 0, 1 << 24);
  if (!c.is_moe() && c.n_ff == 0)
    fail(ErrorKind::InvalidInput, path, ": ", key("feed_forward_length"), " is missing or 0 (a dense model needs it)");
  if (c.is_moe()) {
    c.n_expert_used = int_key(f, key("expert_used_count"), 1, c.n_expert);
    c.n_ff_exp = int_key(f, key("expert_feed_forward_length"), c.n_ff, 1, 1 << 24);
    c.n_ff_shexp = int_key(f, key("expert_shared_feed_forward_length"), 0, 0, 1 << 24);
    if (c.n_ff_shexp == 0)  // a count of shared experts of the routed width
      c.n_ff_shexp = int(int64_t(int_key(f, key("expert_shared_count"), 0, 0, 64)) * c.n_ff_exp);
    c.router.n_expert = c.n_expert;
    c.router.n_used = c.n_expert_used;
    const int64_t gating = f.get_int(key("expert_gating_func"), 1);
    if (gating != 1 && gating != 2 && gating != 4)
      fail(ErrorKind::Unsupported, path, ": expert_gating_func ", gating,
           " is not supported (supported: 1 softmax, 2 sigmoid, 4 sqrtsoftplus)");
    c.router.gating = moe::Gating(gating);
    c.router.norm_topk = f.get_bool(key("expert_weights_norm"), default_norm_topk);
    c.router.scale = float_key(f, key("expert_weights_scale"), 1.0, 1e-6, 1e6);
    c.router.n_group = int_key(f, key("expert_group_count"), 1, 1, c.n_expert);
    c.router.n_group_used = int_key(f, key("expert_group_used_count"), c.router.n_group, 1, c.router.n_group);
    try {
      moe::validate(c.router);
    } catch (const Error& e) {
      fail(ErrorKind::InvalidInput, path, ": invalid expert routing metadata: ", e.what());
    }
  }
  // The kind of each layer: the architecture's, or a sliding window where the file names one.
  c.layer_attention.assign(size_t(c.n_layer), c.attention);
  // llama.cpp's keys: attention.sliding_window (0: none) and attention.sliding_window_pattern,
  // either N (every N-th layer, the last of each N, attends in full) or one bool per layer
  // (true: windowed); absent, every layer has the window.
  if (traits->sliding_window && f.find(key("attention.sliding_window"))) {
    c.sliding_window = int_in(f, key("attention.sliding_window"), f.get_int(key("attention.sliding_window")), 0,
                              std::numeric_limits<int32_t>::max());
    const GgufValue* pattern = f.find(key("attention.sliding_window_pattern"));
    std::vector<bool> windowed(size_t(c.n_layer), true);
    if (pattern && pattern->type == GgufValueType::ARRAY) {
      if (pattern->elem_type != GgufValueType::BOOL || pattern->count != uint64_t(c.n_layer))
        fail(ErrorKind::InvalidInput, path, ": ", key("attention.sliding_window_pattern"), " must be one bool per layer (",
             c.n_layer, "), not ", pattern->count, " ", gguf_type_name(pattern->elem_type), " values");
      uint64_t pos = pattern->begin;
      for (int il = 0; il < c.n_layer; ++il) windowed[size_t(il)] = f.read_element(*pattern, pos).i != 0;
    } else {
      const int period = int_key(f, key("attention.sliding_window_pattern"), 0, 0, 4096);
      for (int il = 0; il < c.n_layer; ++il) windowed[size_t(il)] = period == 0 || (il + 1) % period != 0;
    }
    for (int il = 0; il < c.n_layer && c.sliding_window > 0; ++il)
      if (windowed[size_t(il)]) c.layer_attention[size_t(il)] = AttentionKind::Swa;
  }
  c.n_ctx_train = int_in(f, key("context_length"), f.get_int(key("context_length"), 4096), 1,
                         std::numeric_limits<int32_t>::max());
  c.rms_eps = float_key(f, key("attention.layer_norm_rms_epsilon"), 1e-6, 1e-38, 1.0);
  c.rope_base = float_key(f, key("rope.freq_base"), 10000.0, 1e-38, 1e12);
  c.rope_dim = int_key(f, key("rope.dimension_count"), c.head_dim, 1, 4096);
  if (c.rope_dim > c.head_dim || c.rope_dim % 2 ||
      (c.attention == AttentionKind::Mla && (c.rope_dim >= c.head_dim || c.kv_lora_rank + c.rope_dim > kMaxLatentRow)))
    fail(ErrorKind::InvalidInput, path, ": rope.dimension_count ", c.rope_dim, " is invalid for head_dim ", c.head_dim,
         c.attention == AttentionKind::Mla ? " (MLA: the rope part must be shorter than the key, and kv_lora_rank + "
                                             "rope at most " + std::to_string(kMaxLatentRow) + ")"
                                           : std::string());
  c.qk_nope_dim = c.head_dim - c.rope_dim;
  c.attn_scale = 1.0f / std::sqrt(float(c.head_dim));
  const std::string scaling = f.get_string(key("rope.scaling.type"), "none");
  if (scaling == "linear" || scaling == "yarn") {
    const float factor = float_key(f, key("rope.scaling.factor"), 1.0, 1e-6, 1e6);
    c.rope_freq_scale = float(1.0 / double(factor));
  } else if (scaling != "none" && scaling != "") {
    fail(ErrorKind::Unsupported, path, ": rope scaling '", printable(scaling),
         "' is not supported (supported: none, linear, yarn)");
  }
  if (scaling == "yarn") {
    // llama.cpp's keys and defaults: the trained context, the ramp's rotation counts
    // (beta_fast 32, beta_slow 1), ext_factor 1 and attention factors 1.
    const int64_t orig = f.get_int(key("rope.scaling.original_context_length"), -1);
    if (orig == -1)
      fail(ErrorKind::InvalidInput, path, ": yarn rope scaling needs ", key("rope.scaling.original_context_length"));
    const int orig_ctx = int(int_in(f, key("rope.scaling.original_context_length"), orig, 1, 1 << 30));
    const float beta_fast = float_key(f, key("rope.scaling.yarn_beta_fast"), 32.0, 1e-6, 1e6);
    const float beta_slow = float_key(f, key("rope.scaling.yarn_beta_slow"), 1.0, 1e-6, 1e6);
    const float ext = float_key(f, key("rope.scaling.yarn_ext_factor"), 1.0, 0.0, 1.0);
    const float attn = float_key(f, key("rope.scaling.attn_factor"), 1.0, 1e-6, 1e6) *
                       float_key(f, key("rope.scaling.yarn_attn_factor"), 1.0, 1e-6, 1e6);
    set_yarn(c, orig_ctx, beta_fast, beta_slow, ext, attn);
    if (c.attention == AttentionKind::Mla) {
      // MLA models (as llama.cpp and the reference models run them): the rotation keeps the
      // attention factor only, and the YaRN temperature goes into the softmax scale as mscale^2
      // with mscale = attn_factor (1 + yarn_log_multiplier ln(factor)).
      const float log_mul = float_key(f, key("rope.scaling.yarn_log_multiplier"), 0.0, 0.0, 1e3);
      const float mscale = attn * (1.0f + log_mul * std::log(1.0f / c.rope_freq_scale));
      c.rope_mscale = attn;
      c.attn_scale *= mscale * mscale;
    }
  }
  if (f.find_tensor("rope_freqs.weight"))
    fail(ErrorKind::Unsupported, path, ": per-dimension rope frequency factors (rope_freqs) are not supported yet");
  // Every layer tensor must belong to a layer below block_count: a smaller block_count would
  // silently drop layers.
  for (const GgufTensorInfo& t : f.tensors()) {
    if (t.name.compare(0, 4, "blk.") != 0) continue;
    int64_t layer = 0;
    size_t k = 4;
    while (k < t.name.size() && k < 4 + 12 && t.name[k] >= '0' && t.name[k] <= '9')
      layer = layer * 10 + (t.name[k++] - '0');
    if (k == 4 || k >= t.name.size() || t.name[k] != '.') continue;  // not blk.N.*
    if (layer >= c.n_layer + c.n_nextn)
      fail(ErrorKind::InvalidInput, path, ": tensor '", t.name, "' belongs to layer ", layer, " but ",
           key("block_count"), " = ", c.n_layer + c.n_nextn, " (valid layers: 0..", c.n_layer + c.n_nextn - 1, ")");
  }
  const GgufTensorInfo* emb = f.find_tensor("token_embd.weight");
  if (!emb) fail(ErrorKind::InvalidInput, path, ": tensor token_embd.weight is missing");
  if (emb->ne.size() != 2 || emb->ne[0] != c.n_embd)
    fail(ErrorKind::InvalidInput, path, ": token_embd.weight has the wrong shape");
  c.n_vocab = emb->ne[1];
  c.tied_output = f.find_tensor("output.weight") == nullptr;
  if (c.attention == AttentionKind::SharedKvWindow) c.read_shared_kv(f);
  return c;
}

std::string ModelConfig::summary() const {
  std::ostringstream os;
  os << arch << " '" << name << "': " << n_layer << " layers, n_embd " << n_embd << ", heads "
     << n_head << "/" << n_head_kv << " x " << head_dim << ", ffn " << n_ff << ", vocab " << n_vocab
     << ", rope " << (rope_neox ? "neox" : "norm") << " base " << rope_base
     << (rope_yarn ? " yarn x" : rope_freq_scale != 1.f ? " linear x" : "");
  if (rope_yarn || rope_freq_scale != 1.f) os << 1.0f / rope_freq_scale;
  os
     << (tied_output ? ", tied output" : "");
  if (attention == AttentionKind::Mla)
    os << ", MLA (kv_lora " << kv_lora_rank << ", q_lora " << q_lora_rank << ", nope " << qk_nope_dim << " + rope "
       << rope_dim << ", v " << v_head_dim << ")";
  if (sliding_window > 0) {
    int n = 0;
    for (AttentionKind k : layer_attention) n += k == AttentionKind::Swa;
    os << ", sliding window " << sliding_window << " (" << n << " of " << n_layer << " layers)";
  }
  if (is_moe())
    os << ", " << n_expert << " experts (top-" << n_expert_used << ", width " << n_ff_exp << ")"
       << (n_ff_shexp ? ", shared expert" : "");
  return os.str();
}

}  // namespace tf
