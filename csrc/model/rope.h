// Rotary position embedding variants: plain, linear scaling and YaRN. The angles of a position
// are computed once per token and shared by every layer and head (rope_angles); rope_rotate
// applies them to one head in either pairing (adjacent pairs or NeoX halves).
#pragma once
#include <cstdint>

#include "model/model_config.h"

namespace tf {

// YaRN's ramp for rope_dim dimensions: the correction range of rotation counts beta_fast and
// beta_slow over the trained context orig_ctx (llama.cpp's and transformers' definition), and
// the cos/sin scale attn_factor * (1 + 0.1 ln(factor)). Sets c.rope_yarn and its fields.
void set_yarn(ModelConfig& c, int orig_ctx, float beta_fast, float beta_slow, float ext_factor, float attn_factor);

// cs[2i], cs[2i+1] = cos, sin of dimension pair i's angle at position pos (i < rope_dim / 2),
// times the YaRN scale when it applies.
void rope_angles(const ModelConfig& c, int64_t pos, float* cs);

// Rotates the first rope_dim values of one head by the angles cs.
inline void rope_rotate(float* v, const float* cs, int rope_dim, bool neox) {
  const int half = rope_dim / 2;
  for (int i = 0; i < half; ++i) {
    const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
    const float c = cs[2 * i], s = cs[2 * i + 1];
    const float x0 = v[a], x1 = v[b];
    v[a] = x0 * c - x1 * s;
    v[b] = x0 * s + x1 * c;
  }
}

}  // namespace tf
