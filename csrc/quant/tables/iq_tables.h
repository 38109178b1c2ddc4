// Lookup tables of ggml's IQ and MXFP4 formats (generated into iq_tables.cpp by
// make_iq_tables.py from the gguf package). Grid entry i holds the values of one group of
// 8 (uint64) or 4 (uint32) weights, byte j = value j (signed for kIq1sGrid: -1, 0, 1).
#pragma once
#include <cstdint>

namespace tf::iq {

extern const uint64_t kIq2xxsGrid[256];   // values 8, 25, 43
extern const uint64_t kIq2xsGrid[512];
extern const uint64_t kIq2sGrid[1024];
extern const uint32_t kIq3xxsGrid[256];   // values 4 .. 62
extern const uint32_t kIq3sGrid[512];     // values 1 .. 15
extern const uint64_t kIq1sGrid[2048];    // values -1, 0, 1 (as int8 bytes)
extern const uint8_t kSignsIq2xs[128];    // 7 sign bits + the parity bit that makes 8
extern const int8_t kValuesIq4nl[16];     // IQ4_NL / IQ4_XS non-linear levels
extern const int8_t kValuesMxfp4[16];     // e2m1 values, doubled

}  // namespace tf::iq
