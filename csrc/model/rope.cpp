#include "model/rope.h"

#include <algorithm>
#include <cmath>

namespace tf {

namespace {
// The dimension (of rope_dim) whose wavelength makes n_rot turns over orig_ctx positions.
double correction_dim(int rope_dim, int orig_ctx, double n_rot, double base) {
  return rope_dim * std::log(double(orig_ctx) / (n_rot * 2.0 * M_PI)) / (2.0 * std::log(base));
}
}  // namespace

RopeSpec ModelConfig::rope() const {
  RopeSpec r;
  r.dim = rope_dim;
  r.base = rope_base;
  r.freq_scale = rope_freq_scale;
  r.yarn = rope_yarn;
  r.yarn_low = yarn_low;
  r.yarn_high = yarn_high;
  r.yarn_ext_factor = yarn_ext_factor;
  r.mscale = rope_mscale;
  return r;
}

void set_yarn_ramp(RopeSpec& r, int orig_ctx, float beta_fast, float beta_slow, float ext_factor) {
  const double lo = std::floor(correction_dim(r.dim, orig_ctx, beta_fast, r.base));
  const double hi = std::ceil(correction_dim(r.dim, orig_ctx, beta_slow, r.base));
  r.yarn = true;
  r.yarn_low = float(std::max(0.0, lo));
  r.yarn_high = float(std::min(double(r.dim - 1), hi));
  r.yarn_ext_factor = ext_factor;
}

void set_yarn(ModelConfig& c, int orig_ctx, float beta_fast, float beta_slow, float ext_factor, float attn_factor) {
  RopeSpec r = c.rope();
  set_yarn_ramp(r, orig_ctx, beta_fast, beta_slow, ext_factor);
  c.rope_yarn = true;
  c.yarn_low = r.yarn_low;
  c.yarn_high = r.yarn_high;
  c.yarn_ext_factor = ext_factor;
  // The attention temperature of YaRN, folded into cos/sin (so into q.k twice: 0.1 ln s + 1
  // per side, as both reference implementations apply it).
  c.rope_mscale = ext_factor != 0.f ? attn_factor * (1.0f + 0.1f * std::log(1.0f / c.rope_freq_scale)) : attn_factor;
}

void rope_angles(const RopeSpec& r, int64_t pos, float* cs) {
  const int half = r.dim / 2;
  const float theta_scale = std::pow(r.base, -2.0f / float(r.dim));
  float theta = float(pos);  // the unscaled angle of pair i: pos * base^(-2i / dim)
  if (!r.yarn) {
    for (int i = 0; i < half; ++i) {
      const float th = theta * r.freq_scale;
      cs[2 * i] = std::cos(th);
      cs[2 * i + 1] = std::sin(th);
      theta *= theta_scale;
    }
    return;
  }
  for (int i = 0; i < half; ++i) {
    // ramp 1: as trained (extrapolated); 0: interpolated by the scaling factor
    const float y = (float(i) - r.yarn_low) / std::max(0.001f, r.yarn_high - r.yarn_low);
    const float ramp = (1.0f - std::min(1.0f, std::max(0.0f, y))) * r.yarn_ext_factor;
    const float interp = r.freq_scale * theta;
    const float th = interp * (1.0f - ramp) + theta * ramp;
    cs[2 * i] = std::cos(th) * r.mscale;
    cs[2 * i + 1] = std::sin(th) * r.mscale;
    theta *= theta_scale;
  }
}

}  // namespace tf
