"""`tensorfold info`: what is inside a GGUF."""
from __future__ import annotations

import collections

from . import _core


def _show(v, limit: int = 80) -> str:
    """A metadata value for display: arrays summarised, long text cut, never a traceback."""
    if v is None:
        return "?"
    if isinstance(v, str):
        return v if len(v) <= limit else v[:limit] + "..."
    if isinstance(v, (bool, int, float)):
        return str(v)
    n = _count(v)
    if n is not None:
        et = getattr(v, "elem_type", None) or getattr(v, "dtype", None) or "value"
        return f"<array of {n} {et}>"
    return f"<{type(v).__name__}>"


def _count(v) -> int | None:
    """Number of elements of an array value (numpy array, GgufArray or list); None otherwise."""
    if isinstance(v, (str, bytes, bytearray, dict)) or getattr(v, "ndim", 1) == 0:
        return None
    try:
        return len(v)
    except TypeError:
        return None


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def describe(model: str, show_tensors: bool = False) -> str:
    from .engine import resolve_model

    path = resolve_model(model)
    f = _core.GgufFile(path)
    md = f.metadata()
    arch = md.get("general.architecture")
    arch = arch if isinstance(arch, str) else "?"
    lines = [f"file:          {path}",
             f"size:          {f.file_size / 2**20:.1f} MiB (GGUF v{f.version}, {len(md)} metadata keys)",
             f"name:          {_show(md.get('general.name'))}",
             f"architecture:  {_show(md.get('general.architecture'))}"]
    parts = f.parts
    if len(parts) > 1:
        # A split model (llama.cpp's gguf-split): every file, in split order.
        lines.insert(1, f"parts:         {len(parts)} files (split model; metadata in part 1)")
        for i, p in enumerate(parts):
            lines.insert(2 + i, f"  {i + 1:>5}  {p['path']}  {_size(p['size'])}, {p['n_tensors']} tensors")
    for key in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
                "attention.head_count_kv", "context_length", "rope.freq_base", "expert_count",
                "expert_used_count"):
        v = md.get(f"{arch}.{key}")
        if v is not None:
            lines.append(f"  {key + ':':<26}{_show(v)}")
    try:
        kv = _core.kv_bytes_per_token(f)
        lines.append(f"kv cache:      {kv} bytes per token (F16), {kv * 1024 / 2**20:.1f} MiB per 1K tokens")
    except ValueError as e:  # an architecture or layout the engine refuses: say so, keep going
        lines.append(f"kv cache:      - ({str(e).splitlines()[0]})")
    tok = md.get("tokenizer.ggml.tokens")
    n_tok = _count(tok)
    if tok is None:
        tokens = "0 tokens"
    elif n_tok is None:
        tokens = f"tokenizer.ggml.tokens is not an array ({_show(tok)})"
    else:
        tokens = f"{n_tok} tokens"
    template = md.get("tokenizer.chat_template")
    if isinstance(template, str) or template is None:
        has_template = "yes" if template else "no"
    else:
        has_template = "malformed (not a string)"
    lines.append(f"tokenizer:     {_show(md.get('tokenizer.ggml.model'))} / "
                 f"pre={_show(md.get('tokenizer.ggml.pre'))}, {tokens}, chat template: {has_template}")
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
            part = f"  part {t['part'] + 1}" if len(parts) > 1 else ""
            lines.append(f"  {t['name']:<40} {t['type']:<7} {str(t['shape']):<22} {t['nbytes']:>12}{part}")
    return "\n".join(lines)
