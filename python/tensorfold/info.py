"""`tensorfold info`: what is inside a GGUF."""
from __future__ import annotations

import collections

from . import _core


def describe(model: str, show_tensors: bool = False) -> str:
    from .engine import resolve_model

    path = resolve_model(model)
    f = _core.GgufFile(path)
    md = f.metadata()
    arch = md.get("general.architecture", "?")
    lines = [f"file:          {path}",
             f"size:          {f.file_size / 2**20:.1f} MiB (GGUF v{f.version}, {len(md)} metadata keys)",
             f"name:          {md.get('general.name', '?')}",
             f"architecture:  {arch}"]
    for key in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
                "attention.head_count_kv", "context_length", "rope.freq_base", "expert_count",
                "expert_used_count"):
        v = md.get(f"{arch}.{key}")
        if v is not None:
            lines.append(f"  {key + ':':<26}{v}")
    tok = md.get("tokenizer.ggml.tokens")
    lines.append(f"tokenizer:     {md.get('tokenizer.ggml.model', '?')} / pre={md.get('tokenizer.ggml.pre', '?')}, "
                 f"{len(tok) if tok else 0} tokens, chat template: {'yes' if md.get('tokenizer.chat_template') else 'no'}")
    tensors = f.tensors()
    n_el = collections.Counter()
    n_by = collections.Counter()
    unsupported = set()
    for t in tensors:
        n = 1
        for d in t["shape"]:
            n *= d
        n_el[t["type"]] += n
        n_by[t["type"]] += t["nbytes"]
        if not t["supported"]:
            unsupported.add(t["type"])
    total_el = sum(n_el.values())
    total_by = sum(n_by.values())
    lines.append(f"tensors:       {len(tensors)}, {total_el / 1e6:.1f} M weights, "
                 f"{8 * total_by / max(total_el, 1):.3f} bits per weight")
    for ty, n in sorted(n_el.items(), key=lambda kv: -n_by[kv[0]]):
        lines.append(f"  {ty:<8} {n / 1e6:10.2f} M weights  {n_by[ty] / 2**20:9.1f} MiB  "
                     f"{8 * n_by[ty] / n:6.3f} bpw")
    if unsupported:
        lines.append(f"warning: types not supported by TensorFold yet: {', '.join(sorted(unsupported))}")
    if show_tensors:
        for t in tensors:
            lines.append(f"  {t['name']:<40} {t['type']:<7} {str(t['shape']):<22} {t['nbytes']:>12}")
    return "\n".join(lines)
