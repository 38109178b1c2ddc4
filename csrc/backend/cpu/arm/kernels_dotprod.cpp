// aarch64 kernels at ISA level dotprod (see neon_common.h); built with this level's -march flags.
#define TF_ARM_LEVEL 1
#include "backend/cpu/arm/kernels_arm.inc"
