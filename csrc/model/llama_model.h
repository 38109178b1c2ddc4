// Decoder-only transformer forward pass (llama / qwen2 / qwen3 dense) over a batch of tokens
// from any number of sequences, reading and writing K/V through the paged cache. Weights are
// views into the mmapped GGUF; all scratch is allocated once by reserve().
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "core/dtype.h"
#include "core/thread_pool.h"
#include "gguf/gguf_reader.h"
#include "kv/paged_kv_cache.h"
#include "model/model_config.h"

namespace tf {

// A 2-D weight matrix: `rows` rows of `k` elements, row-major in the file.
struct Weight {
  GgmlType type = GgmlType::F32;
  int64_t k = 0, rows = 0;
  const uint8_t* data = nullptr;
  size_t row_stride = 0;
};

struct LayerWeights {
  const float* attn_norm = nullptr;
  Weight wq, wk, wv, wo;
  const float *bq = nullptr, *bk = nullptr, *bv = nullptr;
  const float *q_norm = nullptr, *k_norm = nullptr;
  const float* ffn_norm = nullptr;
  Weight w_gate, w_up, w_down;
};

struct BatchToken {
  int32_t token = 0;
  int32_t pos = 0;      // position within its sequence
  int32_t seq = 0;      // KV cache sequence slot
  bool want_logits = false;
};

class LlamaModel {
 public:
  explicit LlamaModel(std::shared_ptr<GgufFile> file);

  const ModelConfig& config() const { return cfg_; }
  const GgufFile& file() const { return *file_; }
  uint64_t weight_bytes() const { return weight_bytes_; }

  // Size scratch for batches of up to max_tokens tokens, sequences up to max_ctx positions.
  void reserve(int max_tokens, int64_t max_ctx, int n_threads);
  int max_tokens() const { return max_tokens_; }

  // Runs the batch. For each token with want_logits, writes n_vocab floats to `logits`
  // (consecutive rows, batch order).
  void forward(const std::vector<BatchToken>& batch, PagedKvCache& kv, ThreadPool& pool,
               float* logits);

 private:
  Weight load_weight(const std::string& name, int64_t k, int64_t rows, bool required = true);
  const float* load_vector(const std::string& name, int64_t n, bool required = true);
  void quantize_acts(GgmlType t, const float* x, int64_t T, int64_t k, ThreadPool& pool);
  // y[c * ldy + r] for each weight in ws against the activations last quantized.
  void matmul(std::initializer_list<std::pair<const Weight*, float*>> ws, int64_t T,
              ThreadPool& pool);
  void rmsnorm(const float* x, const float* w, float* y, int64_t T, int64_t n) const;
  void attention(const std::vector<BatchToken>& batch, int layer, PagedKvCache& kv,
                 ThreadPool& pool);

  std::shared_ptr<GgufFile> file_;
  ModelConfig cfg_;
  Weight tok_embd_, output_;
  const float* output_norm_ = nullptr;
  std::vector<LayerWeights> layers_;
  std::vector<std::vector<float>> owned_vectors_;  // norms stored as F16/BF16, converted once
  uint64_t weight_bytes_ = 0;

  // scratch
  int max_tokens_ = 0;
  int64_t max_ctx_ = 0;
  int n_threads_ = 1;
  std::vector<float> x_, xn_, q_, k_, v_, attn_, gate_, up_, rope_cs_, scores_;
  std::vector<uint8_t> act_;
  size_t act_stride_ = 0;
};

}  // namespace tf
