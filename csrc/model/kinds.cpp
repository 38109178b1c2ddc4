// The block kinds: which block each AttentionKind makes, and how a layer's FFN and residual
// are chosen. Adding an attention kind = its block file and one row of kAttentionKinds.
#include "core/error.h"
#include "model/block.h"

namespace tf {

std::unique_ptr<AttentionBlock> make_gqa_attention(const BlockContext& c);
std::unique_ptr<AttentionBlock> make_mla_attention(const BlockContext& c);
std::unique_ptr<AttentionBlock> make_swa_attention(const BlockContext& c);
std::unique_ptr<AttentionBlock> make_shared_kv_window(const BlockContext& c);
std::unique_ptr<AttentionBlock> make_shared_kv_compressed(const BlockContext& c);
std::unique_ptr<AttentionBlock> make_shared_kv_sparse(const BlockContext& c);
std::unique_ptr<FfnBlock> make_dense_ffn(const BlockContext& c);
std::unique_ptr<FfnBlock> make_moe_ffn(const BlockContext& c);
std::unique_ptr<ResidualPolicy> make_single_stream(const ModelConfig& cfg);
std::unique_ptr<ResidualPolicy> make_hyper_streams(const ModelConfig& cfg, WeightLoader& w);

namespace {
struct AttentionKindRow {
  AttentionKind kind;
  std::unique_ptr<AttentionBlock> (*make)(const BlockContext&);
};
const AttentionKindRow kAttentionKinds[] = {
    {AttentionKind::Gqa, make_gqa_attention},
    {AttentionKind::Mla, make_mla_attention},
    {AttentionKind::Swa, make_swa_attention},
    {AttentionKind::SharedKvWindow, make_shared_kv_window},
    {AttentionKind::SharedKvCompressed, make_shared_kv_compressed},
    {AttentionKind::SharedKvSparse, make_shared_kv_sparse},
};
}  // namespace

std::unique_ptr<AttentionBlock> make_attention(AttentionKind kind, const BlockContext& c) {
  for (const AttentionKindRow& r : kAttentionKinds)
    if (r.kind == kind) return r.make(c);
  fail(ErrorKind::Unsupported, "no block for attention kind ", attention_kind_name(kind));
}

std::unique_ptr<FfnBlock> make_ffn(const BlockContext& c) {
  // A layer with a router is MoE (leading dense layers of a MoE model have none).
  const bool routed = c.cfg.is_moe() && c.w.has(c.prefix + "ffn_gate_inp.weight");
  return routed ? make_moe_ffn(c) : make_dense_ffn(c);
}

std::unique_ptr<ResidualPolicy> make_residual(const ModelConfig& cfg, WeightLoader& w) {
  return cfg.hc_mult > 1 ? make_hyper_streams(cfg, w) : make_single_stream(cfg);
}

}  // namespace tf
