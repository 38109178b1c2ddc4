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

void set_yarn(ModelConfig& c, int orig_ctx, float beta_fast, float beta_slow, float ext_factor, float attn_factor) {
  const double lo = std::floor(correction_dim(c.rope_dim, orig_ctx, beta_fast, c.rope_base));
  const double hi = std::ceil(correction_dim(c.rope_dim, orig_ctx, beta_slow, c.rope_base));
  c.rope_yarn = true;
  c.yarn_low = float(std::max(0.0, lo));
  c.yarn_high = float(std::min(double(c.rope_dim - 1), hi));
  c.yarn_ext_factor = ext_factor;
  // The attention temperature of YaRN, folded into cos/sin (so into q.k twice: 0.1 ln s + 1
  // per side, as both reference implementations apply it).
  c.rope_mscale = ext_factor != 0.f ? attn_factor * (1.0f + 0.1f * std::log(1.0f / c.rope_freq_scale)) : attn_factor;
}

void rope_angles(const ModelConfig& c, int64_t pos, float* cs) {
  const int half = c.rope_dim / 2;
  const float theta_scale = std::pow(c.rope_base, -2.0f / float(c.rope_dim));
  float theta = float(pos);  // the unscaled angle of pair i: pos * base^(-2i / rope_dim)
  if (!c.rope_yarn) {
    for (int i = 0; i < half; ++i) {
      const float th = theta * c.rope_freq_scale;
      cs[2 * i] = std::cos(th);
      cs[2 * i + 1] = std::sin(th);
      theta *= theta_scale;
    }
    return;
  }
  for (int i = 0; i < half; ++i) {
    // ramp 1: as trained (extrapolated); 0: interpolated by the scaling factor
    const float y = (float(i) - c.yarn_low) / std::max(0.001f, c.yarn_high - c.yarn_low);
    const float ramp = (1.0f - std::min(1.0f, std::max(0.0f, y))) * c.yarn_ext_factor;
    const float interp = c.rope_freq_scale * theta;
    const float th = interp * (1.0f - ramp) + theta * ramp;
    cs[2 * i] = std::cos(th) * c.rope_mscale;
    cs[2 * i + 1] = std::sin(th) * c.rope_mscale;
    theta *= theta_scale;
  }
}

}  // namespace tf
