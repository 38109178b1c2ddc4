// The metadata of shared-KV attention with compressed caches, hyper-connections and hash
// routing, in llama.cpp's keys (attention.compress_ratios, hyper_connection.*, ...).
#include <cmath>

#include "core/error.h"
#include "model/metadata.h"
#include "model/model_config.h"
#include "model/rope.h"

namespace tf {

namespace {
// One value per layer from an array key (or one scalar for every layer); def where absent.
template <typename T, typename Read>
std::vector<T> per_layer(const GgufFile& f, const std::string& k, int n, T def, Read read) {
  std::vector<T> out(size_t(n), def);
  const GgufValue* v = f.find(k);
  if (!v) return out;
  if (v->type != GgufValueType::ARRAY) {
    out.assign(size_t(n), read(*v));
    return out;
  }
  if (v->count < uint64_t(n))
    fail(ErrorKind::InvalidInput, f.display_path(), ": ", k, " has ", v->count, " values for ", n, " layers");
  uint64_t pos = v->begin;
  for (int i = 0; i < n; ++i) out[size_t(i)] = read(f.read_element(*v, pos));
  return out;
}
}  // namespace

void ModelConfig::read_shared_kv(const GgufFile& f) {
  const std::string& path = f.display_path();
  auto key = [&](const char* k) { return arch + "." + k; };
  if (n_head_kv != 1)
    fail(ErrorKind::InvalidInput, path, ": shared-KV attention has one KV head, not head_count_kv ", n_head_kv);
  sliding_window = int_key(f, key("attention.sliding_window"), 1, 1 << 20);
  q_lora_rank = int_key(f, key("attention.q_lora_rank"), 1, 1 << 16);
  o_groups = int_key(f, key("attention.output_group_count"), 1, n_head);
  o_lora_rank = int_key(f, key("attention.output_lora_rank"), 1, 1 << 16);
  if (n_head % o_groups != 0)
    fail(ErrorKind::InvalidInput, path, ": ", n_head, " heads do not split into ", o_groups, " output groups");
  const int all = n_layer + n_nextn;
  compress_ratio = per_layer<int>(f, key("attention.compress_ratios"), all, -1, [&](const GgufValue& v) {
    return int(int_in(f, key("attention.compress_ratios"), v.i, 0, 1 << 16));
  });
  layer_attention.assign(size_t(n_layer), AttentionKind::SharedKvWindow);
  bool sparse = false;
  for (int il = 0; il < n_layer; ++il) {
    const int r = compress_ratio[size_t(il)];
    if (r < 0) fail(ErrorKind::InvalidInput, path, ": ", key("attention.compress_ratios"), " is missing");
    // Ratio 4 entries overlap (two series, each window's entry also reads the previous window)
    // and are chosen by the indexer; any other ratio is attended in full.
    if (r == 4) sparse = true;
    layer_attention[size_t(il)] = r == 0   ? AttentionKind::SharedKvWindow
                                  : r == 4 ? AttentionKind::SharedKvSparse
                                           : AttentionKind::SharedKvCompressed;
  }
  if (sparse) {
    index_heads = int_key(f, key("attention.indexer.head_count"), 1, 4096);
    index_dim = int_key(f, key("attention.indexer.key_length"), 2, 4096);
    index_topk = int_key(f, key("attention.indexer.top_k"), 1, 1 << 20);
    if (index_dim < rope_dim)
      fail(ErrorKind::InvalidInput, path, ": indexer key_length ", index_dim, " is shorter than the rope ", rope_dim);
  }
  // The compressed branches rotate with their own base and the file's YaRN (cos/sin unscaled:
  // both references cancel YaRN's temperature there); the window-only layers with the plain rope.
  compress_rope = rope();
  compress_rope.base = float_key(f, key("attention.compress_rope_freq_base"), rope_base, 1e-38, 1e12);
  compress_rope.mscale = 1.f;
  if (rope_yarn) {
    const int orig = int(f.get_int(key("rope.scaling.original_context_length")));
    set_yarn_ramp(compress_rope, orig, float_key(f, key("rope.scaling.yarn_beta_fast"), 32.0, 1e-6, 1e6),
                  float_key(f, key("rope.scaling.yarn_beta_slow"), 1.0, 1e-6, 1e6), yarn_ext_factor);
  }
  rope_yarn = false;
  rope_freq_scale = 1.f;
  rope_mscale = 1.f;
  hc_mult = int_key(f, key("hyper_connection.count"), 1, 1, 64);
  hc_sinkhorn_iters = int_key(f, key("hyper_connection.sinkhorn_iterations"), 20, 1, 1000);
  hc_eps = float_key(f, key("hyper_connection.epsilon"), 1e-6, 0.0, 1.0);
  if (is_moe()) {
    hash_layers = int_key(f, key("hash_layer_count"), 0, 0, n_layer);
    auto limit = [&](const char* k) {
      return per_layer<float>(f, key(k), all, 0.f, [&](const GgufValue& v) {
        const double x = v.type == GgufValueType::FLOAT32 || v.type == GgufValueType::FLOAT64 ? v.f : double(v.i);
        if (!std::isfinite(x) || x < 0)
          fail(ErrorKind::InvalidInput, path, ": ", key(k), " holds ", x, " (valid: a finite value >= 0)");
        return float(x);
      });
    };
    swiglu_limit = limit("swiglu_clamp_exp");
    swiglu_limit_shexp = f.find(key("swiglu_clamp_shexp")) ? limit("swiglu_clamp_shexp") : swiglu_limit;
  }
}

}  // namespace tf
