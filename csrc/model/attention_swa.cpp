// Sliding-window attention (the Swa kind): grouped-query attention in which every token reads
// only its last `sliding_window` positions, so its cache group lets go of the blocks behind
// the window (KvSpec::window) and its cost per token stays flat however long the sequence.
// Everything else is GQA's.
#include "model/attention_gqa.h"

namespace tf {

std::unique_ptr<AttentionBlock> make_swa_attention(const BlockContext& c) {
  return std::make_unique<GqaAttention>(c, c.cfg.sliding_window);
}

}  // namespace tf
