// Tensor element types, numbered exactly as GGUF / ggml number them (the on-disk ids).
#pragma once
#include <cstdint>

namespace tf {

enum class GgmlType : uint32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q8_1 = 9,
  Q2_K = 10,
  Q3_K = 11,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  Q8_K = 15,
  IQ2_XXS = 16,
  IQ2_XS = 17,
  IQ3_XXS = 18,
  IQ1_S = 19,
  IQ4_NL = 20,
  IQ3_S = 21,
  IQ2_S = 22,
  IQ4_XS = 23,
  IQ1_M = 29,
  BF16 = 30,
  TQ1_0 = 34,
  TQ2_0 = 35,
  MXFP4 = 39,
};

// One past the largest GGUF type id we know the name of (ggml defines ids up to ~40).
constexpr uint32_t kGgmlTypeIdLimit = 64;

inline float fp16_to_fp32(uint16_t h);
inline uint16_t fp32_to_fp16(float f);
inline float bf16_to_fp32(uint16_t h);

}  // namespace tf

#include "core/half.h"
