"""`tensorfold info`: what is inside a GGUF."""
from __future__ import annotations

import collections

from . import _core
from .util import counted as _n
from .util import human_size  # noqa: F401 - `tensorfold info`'s sizes; importable from here as before


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


_size = human_size


def _counted(v, noun: str) -> str:
    """A count from metadata with its noun ('1 chunk', '4 chunks', '? chunks' when not a number)."""
    if isinstance(v, int) and not isinstance(v, bool):
        return _n(v, noun)
    return f"{_show(v)} {noun}s"


def _imatrix(md: dict, tensors: list[dict]) -> list[str]:
    """What an importance matrix (llama.cpp's GGUF imatrix: `tensorfold calibrate`,
    llama-imatrix) holds: its entries (one per weight matrix), chunks and datasets."""
    entries = sum(1 for t in tensors if t["name"].endswith(".in_sum2"))
    lines = [f"type:          importance matrix (for `tensorfold quantize --calib` and llama-quantize --imatrix), "
             f"{_n(entries, 'entry', 'entries')}"]
    count, size = md.get("imatrix.chunk_count"), md.get("imatrix.chunk_size")
    if isinstance(count, int) and not isinstance(count, bool):
        lines.append(f"  chunks:      {count}" + (f" of {_n(size, 'token')}" if isinstance(size, int) else ""))
    datasets = md.get("imatrix.datasets")
    n = _count(datasets)
    if n:
        shown = [str(d) for d in list(datasets)[:3]]
        more = f" (+{n - 3} more)" if n > 3 else ""
        lines.append(f"  datasets:    {', '.join(_show(d, 60) for d in shown)}{more}")
    for key, what in (("tensorfold.calibrate.model", "model"), ("tensorfold.calibrate.text_sha256", "text sha256")):
        if md.get(key) is not None:
            lines.append(f"  {what + ':':<13}{_show(md.get(key))}")
    return lines


def _cpu_kernels(types: list[str]) -> list[str]:
    """Which instruction set's kernel each format's products run with in the default CPU backend,
    per shape class (measured once per machine and cached: tensorfold.kernel_tuning)."""
    from . import kernel_tuning
    tuned = kernel_tuning.tune(types, _core.usable_cpus())
    table = tuned or kernel_tuning.choices(types)
    if not table:
        return []
    how = "measured" if tuned else "not measured (TENSORFOLD_KERNEL_TUNING=off)"
    repacked = [ty for ty in table if ty in set(_core.cpu_repacked_types())]
    parts = [f"{ty} r8/avx512" if ty in repacked else f"{ty} {c['decode']}/{c['prefill']}" for ty, c in table.items()]
    lines = [f"cpu kernels:   decode/prefill per format, {how}: " + ", ".join(parts)]
    if repacked:
        lines.append(f"cpu layout:    {', '.join(repacked)} rewritten in rows interleaved by eight (r8: one vpdpbusd "
                     "per four values of eight rows) at load; TENSORFOLD_REPACK=off keeps the file's")
    return lines


def _quantize_history(md: dict) -> list[str]:
    """What `tensorfold quantize` recorded: recipe, hashes, version, measured quality."""
    from .quantize import META_PREFIX

    def get(key):
        return md.get(META_PREFIX + key)

    if get("version") is None and get("recipe") is None:
        return []
    lines = [f"quantized by:  tensorfold {_show(get('version'))}"]
    tgt, bpw = get("target_bpw"), get("bpw")
    target = f"target {tgt:.3f} bpw, " if isinstance(tgt, float) else ""
    lines.append(f"  recipe:      {target}{bpw:.3f} bpw" if isinstance(bpw, float) else f"  recipe:      {target}")
    lines.append(f"  source:      {_show(get('source'))}  sha256 {_show(get('source_sha256'))}")
    if get("calib") is not None:
        lines.append(f"  calibration: {_show(get('calib'))}  sha256 {_show(get('calib_sha256'))}")
        if get("calib_text_sha256") is not None:
            lines.append(f"  calib text:  sha256 {_show(get('calib_text_sha256'))}")
    recipe = _json(get("recipe"))
    if isinstance(recipe, dict):
        opts = [f"{k}={recipe[k]}" for k in ("candidates", "keep", "sample_values", "error") if recipe.get(k)]
        if opts:
            lines.append("  options:     " + "; ".join(str(o) for o in opts))
        probe, sens = recipe.get("probe"), recipe.get("sensitivity")
        if isinstance(probe, dict) and isinstance(sens, dict) and sens:
            est = recipe.get("estimated_kld")
            est = f", estimated KLD {est:.4f}" if isinstance(est, (int, float)) else ""
            lines.append(f"  probes:      on {_show(probe.get('text'))} (sha256 {_show(probe.get('text_sha256'), 16)}), "
                         f"{_counted(probe.get('chunks'), 'chunk')} of {_show(probe.get('ctx'))}{est}")
            lines.append("  KLD/error:   " + ", ".join(f"{r} {a:.3g}" for r, a in sens.items()
                                                        if isinstance(a, (int, float))))
        tensors = recipe.get("tensors")
        if isinstance(tensors, dict):
            lines.append(f"  tensor types: {len(tensors)} recorded (`tensorfold info --tensors` lists them)")
    ev = _json(get("eval"))
    if isinstance(ev, dict):
        def num(k, fmt):
            v = ev.get(k)
            return format(v, fmt) if isinstance(v, (int, float)) else "?"
        lines.append(f"  eval:        on {_show(ev.get('text'))} (sha256 {_show(ev.get('text_sha256'), 16)}), "
                     f"{num('scored_tokens', 'd')} tokens: perplexity {num('ppl', '.4f')} (source "
                     f"{num('ppl_ref', '.4f')}), KLD mean {num('kld_mean', '.6f')} p99 "
                     f"{num('kld_p99', '.6f')}, same top token {num('same_top', '.2%')}")
    return lines


def _json(v):
    import json

    if not isinstance(v, str):
        return None
    try:
        return json.loads(v)
    except ValueError:
        return None


def describe(model: str, show_tensors: bool = False) -> str:
    from .engine import resolve_model

    path = resolve_model(model)
    f = _core.GgufFile(path)
    md = f.metadata()
    arch = md.get("general.architecture")
    arch = arch if isinstance(arch, str) else "?"
    lines = [f"file:          {path}",
             f"size:          {human_size(f.file_size)} (GGUF v{f.version}, {_n(len(md), 'metadata key')})"]
    if md.get("general.type") == "imatrix":
        lines.extend(_imatrix(md, f.tensors()))
        return "\n".join(lines)
    lines += [f"name:          {_show(md.get('general.name'))}",
              f"architecture:  {_show(md.get('general.architecture'))}"]
    parts = f.parts
    if len(parts) > 1:
        # A split model (llama.cpp's gguf-split): every file, in split order.
        lines.insert(1, f"parts:         {len(parts)} files (split model; metadata in part 1)")
        for i, p in enumerate(parts):
            lines.insert(2 + i, f"  {i + 1:>5}  {p['path']}  {human_size(p['size'])}, {_n(p['n_tensors'], 'tensor')}")
    for key in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
                "attention.head_count_kv", "context_length", "rope.freq_base", "expert_count",
                "expert_used_count"):
        v = md.get(f"{arch}.{key}")
        if v is not None:
            lines.append(f"  {key + ':':<26}{_show(v)}")
    try:
        kv, per_seq = _core.kv_bytes_per_token(f, per_sequence=True)
        lines.append(f"kv cache:      {kv} bytes per token (F16), {human_size(kv * 1024)} per 1K tokens"
                     + (f" + {human_size(per_seq)} per sequence (sliding windows, at most)" if per_seq else ""))
    except ValueError as e:  # an architecture or layout the engine refuses: say so, keep going
        lines.append(f"kv cache:      - ({str(e).splitlines()[0]})")
    tok = md.get("tokenizer.ggml.tokens")
    n_tok = _count(tok)
    if tok is None:
        tokens = "0 tokens"
    elif n_tok is None:
        tokens = f"tokenizer.ggml.tokens is not an array ({_show(tok)})"
    else:
        tokens = _n(n_tok, "token")
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
        if not t["supported"] and t["type"] not in ("I8", "I16", "I32"):  # integer tables (e.g. hash routing)
            unsupported.add(t["type"])
    total_el = sum(n_el.values())
    total_by = sum(n_by.values())
    lines.append(f"tensors:       {len(tensors)}, {total_el / 1e6:.1f} M weights, "
                 f"{8 * total_by / max(total_el, 1):.3f} bits per weight")
    for ty, n in sorted(n_el.items(), key=lambda kv: -n_by[kv[0]]):
        lines.append(f"  {ty:<8} {n / 1e6:10.2f} M weights  {human_size(n_by[ty]):>11}  "
                     f"{8 * n_by[ty] / max(n, 1):6.3f} bpw")
    lines.extend(_cpu_kernels([ty for ty in n_el if ty not in unsupported]))
    lines.extend(_quantize_history(md))
    if unsupported:
        lines.append(f"warning: types not supported by TensorFold yet: {', '.join(sorted(unsupported))}")
    if show_tensors:
        for t in tensors:
            part = f"  part {t['part'] + 1}" if len(parts) > 1 else ""
            lines.append(f"  {t['name']:<40} {t['type']:<7} {str(t['shape']):<22} {t['nbytes']:>12}{part}")
    return "\n".join(lines)
