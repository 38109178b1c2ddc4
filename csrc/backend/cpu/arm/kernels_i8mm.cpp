// aarch64 kernels at ISA level i8mm (see neon_common.h); built with this level's -march flags.
#define TF_ARM_LEVEL 2
#include "backend/cpu/arm/kernels_arm.inc"
