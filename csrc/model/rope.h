// Rotary position embedding variants: plain, linear scaling and YaRN. The angles of a position
// are computed once per token and shared by every layer and head (rope_angles); the backend
// applies them to each head (Backend::rope: adjacent pairs or NeoX halves).
#pragma once
#include <cstdint>

#include "model/model_config.h"

namespace tf {

// YaRN's ramp for r.dim dimensions: the correction range of rotation counts beta_fast and
// beta_slow over the trained context orig_ctx (llama.cpp's and transformers' definition). Sets
// r.yarn, the ramp and ext_factor; the cos/sin scale (mscale) is the caller's.
void set_yarn_ramp(RopeSpec& r, int orig_ctx, float beta_fast, float beta_slow, float ext_factor);
// The model's main rope with YaRN, the cos/sin scale attn_factor * (1 + 0.1 ln(factor)).
void set_yarn(ModelConfig& c, int orig_ctx, float beta_fast, float beta_slow, float ext_factor, float attn_factor);

// cs[2i], cs[2i+1] = cos, sin of dimension pair i's angle at position pos (i < dim / 2), times
// the YaRN scale when it applies.
void rope_angles(const RopeSpec& r, int64_t pos, float* cs);
inline void rope_angles(const ModelConfig& c, int64_t pos, float* cs) { rope_angles(c.rope(), pos, cs); }

}  // namespace tf
