// Per-op profile of a forward: a backend that times every op of the backend it wraps (the
// decorator holds the real one), keyed by op and, for products, by weight type and shape class,
// with the weight bytes each product read. Made by make_backend when TENSORFOLD_PROFILE_OPS is
// set (bench/profile_decode.py); the costs are a clock read per op, nothing when not made.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "backend/backend.h"

namespace tf {

struct OpCost {
  int64_t calls = 0;
  double seconds = 0.0;
  uint64_t weight_bytes = 0;  // products: the weights read (stacks: the matrices that had rows)
};

// The process-wide profile since the last reset: "op" or "op TYPE decode|prefill" -> cost.
std::map<std::string, OpCost> op_profile();
void reset_op_profile();

std::unique_ptr<Backend> make_profiled_backend(std::unique_ptr<Backend> inner);

}  // namespace tf
