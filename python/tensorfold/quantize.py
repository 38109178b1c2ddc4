"""`tensorfold quantize`: a float GGUF (or a Hugging Face directory) to a quantized GGUF whose
per-tensor types are chosen to minimise the measured error under a bits-per-weight target.

How the types are chosen:

1. Every weight matrix is a unit (a 3-D expert stack is one unit: a GGUF tensor has one
   type). For each candidate type the format's importance-weighted quantizer (C++) is run
   on a sample of the tensor's rows and the output error is measured on it:
   ``err = sum_rows sum_j I_j (w_rj - q_rj)^2`` scaled to all rows, where ``I_j`` is the
   mean square of input channel j over the calibration tokens (``tensorfold calibrate``;
   per expert, with the expert's share of the tokens, so a rarely routed expert weighs
   less). That is the expected squared error the tensor adds to its layer's output per
   token. Without a calibration file I = 1 (plain weight error): allowed, but weaker.
2. A Lagrangian relaxation picks, for a multiplier lambda, the type minimising
   ``err + lambda * bits`` for every tensor; lambda is bisected to the largest total that
   fits the target, then the remaining bits go to the upgrades with the best error saved
   per bit until nothing more fits.
3. The plan (per-role types and bpw, total size) is printed before anything is written;
   the output holds the recipe, the source's and calibration's sha256, the tool version
   and (``--eval``) the measured quality in its metadata (``tensorfold info`` shows them).

Bits per weight are counted over every tensor of the file (norms and routers included),
as ``tensorfold info`` and llama.cpp count them.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import logging
import math
import os
import re
import sys
import tempfile
from typing import Iterable

import numpy as np

from . import __version__, _core
from .util import sha256_file

log = logging.getLogger("tensorfold.quantize")

META_PREFIX = "tensorfold.quantize."
# Written by `tensorfold calibrate`: the sha256 of the calibration text.
TEXT_SHA256_KEY = "tensorfold.calibrate.text_sha256"

# Candidate types, lowest bits first. The allocator only ever considers types the tensor's
# row length allows (K/IQ super-blocks need rows that are multiples of 256).
DEFAULT_CANDIDATES = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "Q2_K", "IQ3_XXS", "IQ3_S", "Q3_K",
                      "IQ4_XS", "IQ4_NL", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0",
                      "F16")
# Never quantized: routers (their outputs pick experts; llama.cpp keeps them F32 too) and
# anything that is not a matrix.
_KEEP_FLOAT = re.compile(r"(^|\.)(ffn_gate_inp|exp_probs_b)(\.|$)")


class QuantizeError(ValueError):
    """A request the quantizer cannot carry out; the message says why and what to do."""


@dataclasses.dataclass(frozen=True)
class QType:
    id: int
    name: str
    block_size: int
    type_size: int

    @property
    def bpw(self) -> float:
        return 8.0 * self.type_size / self.block_size

    def nbytes(self, n_el: int) -> int:
        return n_el // self.block_size * self.type_size


def qtypes() -> dict[str, QType]:
    return {t["name"]: QType(t["id"], t["name"], t["block_size"], t["type_size"]) for t in _core.quant_types()}


@dataclasses.dataclass
class TensorPlan:
    name: str
    shape: tuple[int, ...]          # ggml order: ne0 = row length first
    src_type: str
    role: str
    fixed: str | None = None        # a type forced by --keep / the rules
    candidates: list[str] = dataclasses.field(default_factory=list)
    errors: dict[str, float] = dataclasses.field(default_factory=dict)
    chosen: str | None = None

    @property
    def n_el(self) -> int:
        return math.prod(self.shape)

    @property
    def ncols(self) -> int:
        return self.shape[0]

    @property
    def nrows(self) -> int:
        return self.n_el // self.shape[0]


def role_of(name: str) -> str:
    """'blk.3.ffn_down_exps.weight' -> 'ffn_down_exps'; 'token_embd.weight' -> 'token_embd'."""
    r = re.sub(r"^blk\.\d+\.", "", name)
    return r[:-len(".weight")] if r.endswith(".weight") else r


def parse_keep(specs: Iterable[str], types: dict[str, QType]) -> list[tuple[str, str]]:
    """['*attn_v*=Q8_0', ...] -> [(pattern, TYPE)]; refuses an unknown or unwritable type."""
    out = []
    for s in specs or ():
        if "=" not in s:
            raise QuantizeError(f"--keep {s!r}: expected PATTERN=TYPE, e.g. 'blk.*.attn_v.weight=Q8_0'")
        pat, ty = s.rsplit("=", 1)
        ty = ty.strip().upper()
        if ty not in types or not _core.can_quantize(types[ty].id):
            raise QuantizeError(f"--keep {s!r}: {ty} is not a type TensorFold writes "
                                f"(writable: {', '.join(writable_types(types))})")
        out.append((pat.strip(), ty))
    return out


def writable_types(types: dict[str, QType]) -> list[str]:
    return [n for n, t in types.items() if _core.can_quantize(t.id)]


# --------------------------------------------------------------------------------------
# source tensors


class _Source:
    """A GGUF's tensors as float rows (any type with a reference dequantization)."""

    def __init__(self, path: str, types: dict[str, QType]):
        self.path = path
        self.file = _core.GgufFile(path)
        self.types = types
        self.infos = {t["name"]: t for t in self.file.tensors()}

    def rows(self, name: str, r0: int, r1: int) -> np.ndarray:
        """Rows [r0, r1) of tensor `name` (flattened over all but the first dimension) as float32."""
        t = self.infos[name]
        ncols = t["shape"][0]
        qt = self.types[t["type"]]
        rb = qt.nbytes(ncols)
        raw = self.file.tensor_data(name)[r0 * rb:r1 * rb]
        if qt.name == "F32":
            return raw.view(np.float32).reshape(r1 - r0, ncols).copy()
        if qt.name == "F16":
            return raw.view(np.float16).reshape(r1 - r0, ncols).astype(np.float32)
        if qt.name == "BF16":
            return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(r1 - r0, ncols)
        return _core.dequantize(qt.id, raw, (r1 - r0) * ncols).reshape(r1 - r0, ncols)


# --------------------------------------------------------------------------------------
# importance


class Importance:
    """Per-column importance of each weight matrix from an imatrix file (ours or llama.cpp's):
    sum of squares / all calibration tokens, per expert for 3-D tensors."""

    def __init__(self, path: str | None, n_mat: dict[str, int] | None = None):
        self.path = path
        self.entries: dict[str, np.ndarray] = {}
        self.text_sha256: str | None = None
        self.tokens = 0
        if path is None:
            return
        from .calibrate import load_imatrix

        data = load_imatrix(path, n_mat)
        sha = _core.GgufFile(path).metadata().get(TEXT_SHA256_KEY)
        self.text_sha256 = sha if isinstance(sha, str) else None
        # Dense tensors see every token: their count is the number of calibration tokens.
        self.tokens = int(max((float(np.max(c)) for _, c in data.values()), default=0))
        if self.tokens <= 0:
            raise QuantizeError(f"{path}: the importance matrix holds no tokens")
        for name, (sum2, counts) in data.items():
            self.entries[name] = np.asarray(sum2, np.float64) / self.tokens

    def __bool__(self) -> bool:
        return bool(self.entries)

    def for_tensor(self, t: TensorPlan) -> np.ndarray | None:
        """[n_mat, ncols] float32 (n_mat = experts for a 3-D tensor, else 1), or None (uniform)."""
        e = self.entries.get(t.name)
        if e is None:
            return None
        n_mat = t.shape[2] if len(t.shape) == 3 else 1
        if e.shape != (n_mat, t.ncols):
            raise QuantizeError(f"the importance matrix of {t.name} has shape {e.shape}, the tensor needs "
                                f"({n_mat}, {t.ncols}): was it made for another model?")
        # A column no calibration token touched still matters a little (other texts touch it).
        floor = 1e-6 * float(e.max()) if e.size and e.max() > 0 else 1.0
        return np.maximum(e, floor).astype(np.float32)


# --------------------------------------------------------------------------------------
# the plan


def build_plan(src: _Source, keep: list[tuple[str, str]], candidates: list[str]) -> list[TensorPlan]:
    plans = []
    for name, t in src.infos.items():
        shape = tuple(int(d) for d in t["shape"])
        p = TensorPlan(name, shape, t["type"], role_of(name))
        if len(shape) < 2 or _KEEP_FLOAT.search(name):
            # norms, biases, routers: F32 whatever the rules say (their bytes are negligible)
            p.fixed = "F32"
        else:
            for pat, ty in keep:
                if fnmatch.fnmatchcase(name, pat) or fnmatch.fnmatchcase(p.role, pat):
                    p.fixed = ty
                    break
        if p.fixed is not None:
            qt = src.types[p.fixed]
            if p.ncols % qt.block_size:
                raise QuantizeError(f"--keep: {name} has rows of {p.ncols} values, not a multiple of "
                                    f"{p.fixed}'s block of {qt.block_size}")
            p.chosen = p.fixed
        else:
            p.candidates = [c for c in candidates if p.ncols % src.types[c].block_size == 0]
            if not p.candidates:
                p.candidates = ["F16"]
        plans.append(p)
    return plans


def _sample_rows(p: TensorPlan, budget: int) -> np.ndarray:
    """Evenly spread row indices (over all experts) holding about `budget` values."""
    n = min(p.nrows, max(8, budget // p.ncols))
    return np.unique(np.linspace(0, p.nrows - 1, n).round().astype(np.int64))


def measure_errors(src: _Source, plans: list[TensorPlan], imp: Importance, *, sample: int, threads: int,
                   progress: bool) -> None:
    """err[type] of every free tensor: weighted squared output error per token, all rows."""
    free = [p for p in plans if p.fixed is None and len(p.candidates) > 1]
    bar = _bar(progress, total=sum(len(p.candidates) for p in free), desc="measure", unit="trial")
    try:
        for p in free:
            rows = _sample_rows(p, sample)
            x = np.concatenate([src.rows(p.name, int(r), int(r) + 1) for r in rows]) if len(rows) < p.nrows \
                else src.rows(p.name, 0, p.nrows)
            weights = imp.for_tensor(p)
            rows_per_mat = p.nrows // (p.shape[2] if len(p.shape) == 3 else 1)
            w_rows = np.ones((len(rows), p.ncols), np.float32) if weights is None \
                else weights[rows // rows_per_mat]
            scale = p.nrows / len(rows)
            for c in p.candidates:
                qt = src.types[c]
                q = _quantize_matrix(qt, x, w_rows, threads)
                d = _core.dequantize(qt.id, q, x.size).reshape(x.shape)
                p.errors[c] = float(np.sum(w_rows * (x - d) ** 2, dtype=np.float64)) * scale
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()


def _probe_type(p: TensorPlan, types: dict[str, QType], target_bpw: float) -> str:
    """The candidate a sensitivity probe quantizes p to: about 1.5 bpw under the target, where
    errors are large enough to measure yet still in the regime the allocation works in."""
    below = [c for c in p.candidates if types[c].bpw <= target_bpw - 1.5 and p.errors.get(c, 0.0) > 0]
    if below:
        return max(below, key=lambda c: types[c].bpw)
    return min(p.candidates, key=lambda c: types[c].bpw)


def _near_lossless_type(p: TensorPlan, types: dict[str, QType]) -> str:
    """Q8_0 where the row length allows (the same quantized-activation path as the other
    quantized types, with almost no weight error); otherwise the widest candidate."""
    if "Q8_0" in p.candidates:
        return "Q8_0"
    return max(p.candidates, key=lambda c: types[c].bpw)


def measure_sensitivity(src: _Source, plans: list[TensorPlan], imp: Importance, types: dict[str, QType],
                        target_bpw: float, text: str, *, ctx: int, chunks: int, threads: int, tmpdir: str,
                        layer_bands: int = 0, progress: bool, echo) -> tuple[dict[str, float], dict[str, float]]:
    """Scales every free tensor's errors by its role's measured KL divergence per unit of error.

    The weighted squared output error of one tensor is comparable with another's only inside
    a role (a 1e-3 error in the logits weighs differently from one in a layer's attn_q
    output). So for each role all its tensors are quantized to a probe type (the others stay
    as in the source), the model's KL divergence from the source is measured on `text`, and
    alpha = (KLD - floor) / (summed error at the probe type - at Q8_0). The floor is the KLD
    of all free tensors at Q8_0 (the quantized-activation paths alone), shared out by weight
    count. Errors then read as estimated KLD, summed over the tensors by the allocation.

    With layer_bands > 1 the layers are also cut into that many bands and each band (all its
    free tensors at their probe types) is probed: beta = its measured KLD / the KLD the role
    alphas predict for it scales the band's errors, so early or late layers that matter more
    than their role's average get more bits. Returns ({role: alpha}, {band: beta})."""
    from .engine import Engine
    from .evaluate import ReferenceDistributions

    free = [p for p in plans if p.fixed is None and len(p.candidates) > 1 and p.errors]
    roles: dict[str, list[TensorPlan]] = {}
    for p in free:
        roles.setdefault(p.role, []).append(p)
    if not roles:
        return {}, {}
    layer_of = {p.name: int(m.group(1)) for p in free if (m := re.match(r"blk\.(\d+)\.", p.name))}
    bands: dict[str, list[TensorPlan]] = {}
    if layer_bands > 1 and layer_of:
        n_layers = max(layer_of.values()) + 1
        size = -(-n_layers // min(layer_bands, n_layers))
        for p in free:
            if p.name in layer_of:
                b0 = layer_of[p.name] // size * size
                bands.setdefault(f"blk.{b0}-{min(b0 + size, n_layers) - 1}", []).append(p)
    opts = dict(threads=threads, context=ctx, kv_tokens=ctx, prefix_cache=False)
    with Engine(src.path, **opts) as ref:
        reference = ReferenceDistributions(ref, text, ctx=ctx, max_chunks=chunks)
    probe_file = os.path.join(tmpdir, "probe.gguf")
    bar = _bar(progress, total=len(roles) + len(bands) + 1, desc="probe", unit="probe")

    def probe(assign: dict[str, str]) -> float:
        variant = [dataclasses.replace(p, chosen=assign.get(p.name, p.src_type)) for p in plans]
        _write(probe_file, src.path, variant, types, {},
               lambda p: _quantized_tensor(src, imp, p, types, threads), progress=False, desc="probe")
        try:
            with Engine(probe_file, **opts) as m:
                return reference.kld(m)
        finally:
            os.remove(probe_file)

    try:
        high = {p.name: _near_lossless_type(p, types) for p in free}
        floor = probe(high)
        if bar is not None:
            bar.update(1)
        n_free = sum(p.n_el for p in free)
        alpha: dict[str, float] = {}
        rows = []
        for role, ps in roles.items():
            low = {p.name: _probe_type(p, types, target_bpw) for p in ps}
            kld = probe(low)
            share = floor * sum(p.n_el for p in ps) / n_free
            d_err = sum(p.errors[low[p.name]] - p.errors.get(high[p.name], 0.0) for p in ps)
            d_kld = kld - share
            alpha[role] = d_kld / d_err if d_err > 0 and d_kld > 0 else float("nan")
            rows.append((role, ", ".join(sorted(set(low.values()))), kld))
            if bar is not None:
                bar.set_postfix_str(role, refresh=False)
                bar.update(1)
        # A role whose probe changed nothing measurable still costs something: the smallest alpha.
        known = [a for a in alpha.values() if math.isfinite(a)]
        fallback = min(known) if known else 1.0
        for role in alpha:
            if not math.isfinite(alpha[role]):
                alpha[role] = fallback
        for p in free:
            a = alpha[p.role]
            p.errors = {c: a * e for c, e in p.errors.items()}
        beta: dict[str, float] = {}
        band_rows = []
        for band, ps in sorted(bands.items(), key=lambda kv: int(kv[0][4:].split("-")[0])):
            low = {p.name: _probe_type(p, types, target_bpw) for p in ps}
            kld = probe(low)
            predicted = sum(p.errors[low[p.name]] - p.errors.get(high[p.name], 0.0) for p in ps)
            measured = kld - floor * sum(p.n_el for p in ps) / n_free
            beta[band] = measured / predicted if predicted > 0 and measured > 0 else 1.0
            band_rows.append((band, kld, predicted))
            for p in ps:
                p.errors = {c: beta[band] * e for c, e in p.errors.items()}
            if bar is not None:
                bar.set_postfix_str(band, refresh=False)
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    echo(f"sensitivity (KLD on {len(reference.chunks)} chunks of {ctx}; all free tensors at Q8_0: {floor:.5f}):")
    echo(f"  {'role':<18} {'probe type':<12} {'KLD':>9} {'KLD per unit error':>19}")
    for role, ty, kld in rows:
        echo(f"  {role:<18} {ty:<12} {kld:>9.5f} {alpha[role]:>19.4g}")
    if band_rows:
        echo(f"  {'layers':<18} {'':<12} {'KLD':>9} {'predicted':>9} {'scale':>9}")
        for band, kld, pred in band_rows:
            echo(f"  {band:<18} {'':<12} {kld:>9.5f} {pred:>9.5f} {beta[band]:>9.3g}")
    return alpha, beta


def _quantize_matrix(qt: QType, x: np.ndarray, w_rows: np.ndarray | None, threads: int) -> np.ndarray:
    """Rows of x with per-row importance rows (identical rows are batched into one call)."""
    if w_rows is None:
        return _core.quantize_rows(qt.id, x, None, threads)
    out = np.empty((x.shape[0], qt.nbytes(x.shape[1])), np.uint8)
    start = 0
    while start < x.shape[0]:
        end = start + 1
        while end < x.shape[0] and np.array_equal(w_rows[end], w_rows[start]):
            end += 1
        out[start:end] = _core.quantize_rows(qt.id, np.ascontiguousarray(x[start:end]), w_rows[start], threads)
        start = end
    return out


def total_bits(plans: list[TensorPlan], types: dict[str, QType]) -> int:
    return sum(8 * types[p.chosen].nbytes(p.n_el) for p in plans)


def allocate(plans: list[TensorPlan], types: dict[str, QType], target_bpw: float) -> None:
    """Chooses p.chosen for every free tensor to minimise the summed error with the file's
    bits per weight at most target_bpw (as close to it as the tensors' sizes allow)."""
    n_total = sum(p.n_el for p in plans)
    fixed_bits = sum(8 * types[p.fixed].nbytes(p.n_el) for p in plans if p.fixed)
    free = [p for p in plans if p.fixed is None]
    budget = target_bpw * n_total - fixed_bits

    def bits(p: TensorPlan, c: str) -> int:
        return 8 * types[c].nbytes(p.n_el)

    def err(p: TensorPlan, c: str) -> float:
        return p.errors.get(c, 0.0)

    lo_bits = sum(min(bits(p, c) for c in p.candidates) for p in free)
    hi_bits = sum(max(bits(p, c) for c in p.candidates) for p in free)
    if lo_bits > budget:
        raise QuantizeError(f"--target-bpw {target_bpw:g} is below what the candidate types allow: at least "
                            f"{(lo_bits + fixed_bits) / n_total:.3f} bpw (allow smaller types with --types, or "
                            f"raise the target)")
    if hi_bits <= budget:
        for p in free:
            p.chosen = max(p.candidates, key=lambda c: (bits(p, c), -err(p, c)))
        return

    def pick(lam: float) -> None:
        for p in free:
            p.chosen = min(p.candidates, key=lambda c: (err(p, c) + lam * bits(p, c), bits(p, c)))

    def used_bits() -> int:
        return sum(bits(p, p.chosen) for p in free)

    # Errors per bit span many decades: bracket lambda geometrically, then bisect in log space.
    hi = 1.0
    pick(hi)
    while used_bits() > budget and hi < 1e300:
        hi *= 16.0
        pick(hi)
    lo = hi
    while lo > 1e-300:
        lo /= 16.0
        pick(lo)
        if used_bits() > budget:
            break
    for _ in range(200):
        if hi / lo < 1 + 1e-12:
            break
        mid = math.sqrt(lo * hi)
        pick(mid)
        if used_bits() > budget:
            lo = mid
        else:
            hi = mid
    pick(hi)
    # Spend what is left: the upgrade saving most error per extra bit, repeatedly.
    used = used_bits()
    while True:
        best = None
        for p in free:
            e0, b0 = err(p, p.chosen), bits(p, p.chosen)
            for c in p.candidates:
                db = bits(p, c) - b0
                de = e0 - err(p, c)
                if db <= 0 or de <= 0 or used + db > budget:
                    continue
                gain = de / db
                if best is None or gain > best[0]:
                    best = (gain, p, c, db)
        if best is None:
            break
        _, p, c, db = best
        p.chosen = c
        used += db


def plan_table(plans: list[TensorPlan], types: dict[str, QType], target_bpw: float | None) -> str:
    roles: dict[str, list[TensorPlan]] = {}
    for p in plans:
        roles.setdefault(p.role, []).append(p)
    lines = [f"{'role':<18} {'tensors':>7} {'M weights':>10} {'bpw':>6} {'MiB':>9}  types"]
    for role, ps in roles.items():
        n = sum(p.n_el for p in ps)
        b = sum(types[p.chosen].nbytes(p.n_el) for p in ps)
        counts: dict[str, int] = {}
        for p in ps:
            counts[p.chosen] = counts.get(p.chosen, 0) + 1
        desc = ", ".join(f"{t}x{k}" if k > 1 else t for t, k in sorted(counts.items(), key=lambda kv: -kv[1]))
        lines.append(f"{role:<18} {len(ps):>7} {n / 1e6:>10.2f} {8 * b / n:>6.2f} {b / 2**20:>9.1f}  {desc}")
    n = sum(p.n_el for p in plans)
    b = sum(types[p.chosen].nbytes(p.n_el) for p in plans)
    tgt = f" (target {target_bpw:g})" if target_bpw is not None else ""
    lines.append(f"total: {len(plans)} tensors, {n / 1e6:.1f} M weights, {b / 2**20:.1f} MiB "
                 f"({b / 1e6:.1f} MB) of tensor data, {8 * b / n:.3f} bpw{tgt}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# writing


def _copy_kv(writer, reader) -> None:
    """Every key of the source except the ones the writer owns or this run replaces."""
    import gguf

    skip_prefix = ("GGUF.", "split.", META_PREFIX)
    skip = {"general.architecture", "general.file_type", "general.quantization_version", "general.alignment"}
    for field in reader.fields.values():
        if field.name in skip or field.name.startswith(skip_prefix):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY and len(field.types) > 1 else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)


_FTYPE = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q4_0": "MOSTLY_Q4_0",
          "Q4_1": "MOSTLY_Q4_1", "Q5_0": "MOSTLY_Q5_0", "Q5_1": "MOSTLY_Q5_1", "Q8_0": "MOSTLY_Q8_0",
          "Q2_K": "MOSTLY_Q2_K", "Q3_K": "MOSTLY_Q3_K_M", "Q4_K": "MOSTLY_Q4_K_M", "Q5_K": "MOSTLY_Q5_K_M",
          "Q6_K": "MOSTLY_Q6_K", "IQ2_XXS": "MOSTLY_IQ2_XXS", "IQ2_XS": "MOSTLY_IQ2_XS", "IQ2_S": "MOSTLY_IQ2_S",
          "IQ3_XXS": "MOSTLY_IQ3_XXS", "IQ3_S": "MOSTLY_IQ3_S", "IQ1_S": "MOSTLY_IQ1_S", "IQ1_M": "MOSTLY_IQ1_M",
          "IQ4_NL": "MOSTLY_IQ4_NL", "IQ4_XS": "MOSTLY_IQ4_XS", "TQ1_0": "MOSTLY_TQ1_0", "TQ2_0": "MOSTLY_TQ2_0"}


def _file_type(plans: list[TensorPlan], types: dict[str, QType]) -> int:
    """general.file_type: llama.cpp's label of the type holding most bytes (display only)."""
    import gguf

    by: dict[str, int] = {}
    for p in plans:
        by[p.chosen] = by.get(p.chosen, 0) + types[p.chosen].nbytes(p.n_el)
    main = max(by, key=by.get)
    ft = getattr(gguf.LlamaFileType, _FTYPE.get(main, ""), None)
    return int(ft) if ft is not None else int(gguf.LlamaFileType.GUESSED)


def _write(out_path: str, src_path: str, plans: list[TensorPlan], types: dict[str, QType], meta: dict,
           tensor_bytes, *, progress: bool, desc: str) -> None:
    """Writes out_path (via out_path.part, renamed at the end). tensor_bytes(plan) -> uint8 array."""
    import gguf

    reader = gguf.GGUFReader(src_path)
    arch = _core.GgufFile(src_path).metadata().get("general.architecture")
    tmp = out_path + ".part"
    writer = gguf.GGUFWriter(tmp, arch)
    try:
        _copy_kv(writer, reader)
        del reader
        writer.add_file_type(_file_type(plans, types))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for k, v in meta.items():
            if isinstance(v, float):
                writer.add_float32(META_PREFIX + k, v)
            else:
                writer.add_string(META_PREFIX + k, v if isinstance(v, str) else json.dumps(v, sort_keys=True))
        for p in plans:
            qt = types[p.chosen]
            np_shape = tuple(reversed(p.shape))
            raw = None if qt.name in ("F32", "F16") else gguf.GGMLQuantizationType(qt.id)
            dt = np.float16 if qt.name == "F16" else np.float32
            writer.add_tensor_info(p.name, np_shape, np.dtype(dt), qt.nbytes(p.n_el), raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        bar = _bar(progress, total=sum(p.n_el for p in plans), desc=desc, unit="w", unit_scale=True)
        try:
            for p in plans:
                data = tensor_bytes(p)
                writer.write_tensor_data(data)
                if bar is not None:
                    bar.set_postfix_str(f"{p.name} {p.chosen}", refresh=False)
                    bar.update(p.n_el)
        finally:
            if bar is not None:
                bar.close()
        writer.close()
        os.replace(tmp, out_path)
    except BaseException:
        writer.close()
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _quantized_tensor(src: _Source, imp: Importance, p: TensorPlan, types: dict[str, QType],
                      threads: int) -> np.ndarray:
    qt = types[p.chosen]
    if p.chosen == p.src_type:  # nothing to do: copy the bytes
        return np.array(src.file.tensor_data(p.name))
    weights = imp.for_tensor(p)
    n_mat = p.shape[2] if len(p.shape) == 3 else 1
    rows_per_mat = p.nrows // n_mat
    rb = qt.nbytes(p.ncols)
    out = np.empty(p.nrows * rb, np.uint8)
    step = max(1, min(rows_per_mat, (1 << 24) // p.ncols))  # bounded float buffers (64 MiB)
    for m in range(n_mat):
        w = None if weights is None else weights[m]
        for r0 in range(m * rows_per_mat, (m + 1) * rows_per_mat, step):
            r1 = min(r0 + step, (m + 1) * rows_per_mat)
            x = src.rows(p.name, r0, r1)
            out[r0 * rb:r1 * rb] = _core.quantize_rows(qt.id, x, w, threads).reshape(-1)
    return out


def _bar(progress: bool, **kw):
    if not progress:
        return None
    from tqdm import tqdm

    return tqdm(file=sys.stderr, leave=False, **kw)


# --------------------------------------------------------------------------------------
# entry point


@dataclasses.dataclass
class QuantizeResult:
    path: str
    bpw: float
    nbytes: int
    plan: str
    eval: dict | None = None


def check_dependencies(src_path: str) -> None:
    """What quantizing `src_path` needs beyond the core, checked before anything is loaded or
    measured: the gguf package (it writes the output and reads --calib), and for a Hugging Face
    directory safetensors (the 'convert' extra)."""
    from .calibrate import missing_module_error

    err = missing_module_error("gguf", "tensorfold quantize (writing the GGUF)")
    if err is None and os.path.isdir(src_path):
        err = missing_module_error("safetensors", "quantizing a Hugging Face directory (reading its safetensors)",
                                   extra="convert")
    if err is not None:
        raise err


def quantize(src_path: str, out_path: str, *, target_bpw: float | None, calib: str | None = None,
             keep: list[str] | None = None, candidates: list[str] | None = None, threads: int | None = None,
             sample: int = 1 << 16, eval_text: str | None = None, eval_ctx: int = 512,
             eval_chunks: int | None = 16, probe_text: str | None = None, probe_chunks: int = 4,
             probe_layer_bands: int = 0, dry_run: bool = False, progress: bool = True, echo=print) -> QuantizeResult:
    """Quantizes the GGUF (or Hugging Face directory) src_path into out_path; see the module doc."""
    check_dependencies(src_path)
    types = qtypes()
    threads = threads or max(1, min(os.cpu_count() or 1, 256))
    if target_bpw is not None and not (0 < target_bpw <= 32):
        raise QuantizeError(f"--target-bpw must be in (0, 32], got {target_bpw:g}")
    cands = list(candidates) if candidates else [c for c in DEFAULT_CANDIDATES if _core.can_quantize(types[c].id)]
    for c in cands:
        if c not in types or not _core.can_quantize(types[c].id):
            raise QuantizeError(f"--types: {c} is not a type TensorFold writes (writable: "
                                f"{', '.join(writable_types(types))})")
    keep_rules = parse_keep(keep or [], types)
    if target_bpw is None and not keep_rules:
        raise QuantizeError("give --target-bpw (and/or --keep PATTERN=TYPE rules for every tensor)")
    if os.path.abspath(out_path) == os.path.abspath(src_path):
        raise QuantizeError("the output would overwrite the input; choose another -o")

    tmpdir = None
    sensitivity: dict[str, float] = {}
    layer_scale: dict[str, float] = {}
    try:
        if os.path.isdir(src_path):
            from .convert import convert

            tmpdir = tempfile.mkdtemp(prefix="tf-quantize-", dir=os.path.dirname(os.path.abspath(out_path)))
            gguf_src = convert(src_path, os.path.join(tmpdir, "source-f16.gguf"), "f16", progress=progress)
        elif os.path.isfile(src_path):
            gguf_src = src_path
        else:
            from .engine import path_error

            err = path_error(src_path, "input")
            if err is not None:
                raise err
            raise QuantizeError(f"{src_path}: no such file or directory (expected a GGUF or a Hugging Face "
                                f"checkpoint directory)")
        src = _Source(gguf_src, types)
        eval_input = None if eval_text is None else _read_text(eval_text, "--eval")
        requant = sorted({t["type"] for t in src.infos.values() if t["type"] not in ("F32", "F16", "BF16")})
        if requant:
            echo(f"warning: {src_path} already holds quantized tensors ({', '.join(requant)}); they are "
                 f"dequantized and quantized again, which adds the errors of both", file=sys.stderr)
        imp = Importance(calib, {n: t["shape"][2] for n, t in src.infos.items() if len(t["shape"]) == 3})
        probe = None
        if probe_text is not None and target_bpw is not None:
            probe_raw, probe = _read_text(probe_text, "--probe-text")
        elif target_bpw is not None:
            echo("note: no --probe-text: tensors of different roles are compared by their weighted output "
                 "error alone; --probe-text (e.g. the calibration text) measures each role's KL divergence "
                 "per unit of error and places bits much better", file=sys.stderr)
        if calib is None and target_bpw is not None:
            echo("note: no --calib file: errors are weighed uniformly over input channels; an importance "
                 "matrix from `tensorfold calibrate` places bits better", file=sys.stderr)
        plans = build_plan(src, keep_rules, cands)
        if target_bpw is None:
            missing = [p.name for p in plans if p.fixed is None]
            if missing:
                raise QuantizeError(f"without --target-bpw every tensor needs a --keep rule; {len(missing)} have "
                                    f"none (e.g. {missing[0]})")
        else:
            measure_errors(src, plans, imp, sample=sample, threads=threads, progress=progress)
            if probe is not None:
                if tmpdir is None:
                    tmpdir = tempfile.mkdtemp(prefix="tf-quantize-",
                                              dir=os.path.dirname(os.path.abspath(out_path)))
                sensitivity, layer_scale = measure_sensitivity(
                    src, plans, imp, types, target_bpw, probe, ctx=eval_ctx, chunks=probe_chunks, threads=threads,
                    tmpdir=tmpdir, layer_bands=probe_layer_bands, progress=progress, echo=echo)
            allocate(plans, types, target_bpw)
        table = plan_table(plans, types, target_bpw)
        estimated_kld = None
        if sensitivity:
            # first order: the probes' KLD per unit error times each chosen type's error, summed
            estimated_kld = sum(p.errors.get(p.chosen, 0.0) for p in plans if p.fixed is None)
            table += f"\nestimated KLD from the probes (sum over tensors, first order): {estimated_kld:.4f}"
        echo(table)
        n_el = sum(p.n_el for p in plans)
        nbytes = sum(types[p.chosen].nbytes(p.n_el) for p in plans)
        bpw = 8.0 * nbytes / n_el
        if dry_run:
            return QuantizeResult(out_path, bpw, nbytes, table)

        src_files = [part["path"] for part in src.file.parts]
        meta: dict = {
            "version": __version__,
            "source": os.path.basename(os.path.normpath(src_path)),
            "source_sha256": sha256_file(*src_files),
            "bpw": bpw,
            "recipe": {
                "target_bpw": target_bpw,
                "candidates": cands,
                "keep": [f"{p}={t}" for p, t in keep_rules],
                "sample_values": sample,
                "error": ("importance-weighted squared output error per token" if imp else
                          "squared weight error") + (" times its role's measured KLD per unit error"
                                                     if sensitivity else ""),
                "sensitivity": sensitivity,
                "layer_sensitivity": layer_scale,
                "estimated_kld": estimated_kld,
                "tensors": {p.name: p.chosen for p in plans},
            },
        }
        if target_bpw is not None:
            meta["target_bpw"] = float(target_bpw)
        if probe is not None:
            meta["recipe"]["probe"] = {"text": os.path.basename(probe_text), "chunks": probe_chunks,
                                       "layer_bands": probe_layer_bands,
                                       "ctx": eval_ctx, "text_sha256": hashlib.sha256(probe_raw).hexdigest()}
        if calib is not None:
            meta["calib"] = os.path.basename(calib)
            meta["calib_sha256"] = sha256_file(calib)
            if imp.text_sha256:
                meta["calib_text_sha256"] = imp.text_sha256
        out_dir = os.path.dirname(os.path.abspath(out_path))
        os.makedirs(out_dir, exist_ok=True)
        _write(out_path, gguf_src, plans, types, meta,
               lambda p: _quantized_tensor(src, imp, p, types, threads), progress=progress, desc="quantize")
        result = QuantizeResult(out_path, bpw, nbytes, table)
        if eval_text is not None:
            result.eval = _eval_and_record(out_path, gguf_src, plans, types, meta, eval_text, eval_input, eval_ctx,
                                           eval_chunks, threads, progress, echo)
        return result
    finally:
        if tmpdir is not None:
            import shutil

            shutil.rmtree(tmpdir, ignore_errors=True)


def _read_text(path: str, option: str) -> tuple[bytes, str]:
    from .evaluate import read_text

    try:
        return read_text(path, option)
    except ValueError as e:
        raise QuantizeError(str(e)) from None


def _eval_and_record(out_path, ref_path, plans, types, meta, text_path, text_input, ctx, chunks, threads, progress,
                     echo) -> dict:
    """Measures out_path against the source on the text and rewrites it with the results."""
    from .engine import Engine
    from .evaluate import evaluate

    raw, text = text_input
    opts = dict(threads=threads, context=ctx, kv_tokens=ctx, prefix_cache=False)
    with Engine(ref_path, **opts) as ref, Engine(out_path, **opts) as model:
        r = evaluate(model, text, ref=ref, ctx=ctx, max_chunks=chunks, progress=progress)
    echo(r.table())
    res = json.loads(r.to_json())
    res["text_sha256"] = hashlib.sha256(raw).hexdigest()
    res["text"] = os.path.basename(text_path)
    meta = dict(meta, eval=res)
    quantized = _core.GgufFile(out_path)
    tmp_src = out_path + ".noeval"
    os.replace(out_path, tmp_src)
    try:
        _write(out_path, tmp_src, plans, types, meta,
               lambda p: np.array(quantized.tensor_data(p.name)), progress=False, desc="record")
    except BaseException:
        os.replace(tmp_src, out_path)
        raise
    quantized = None  # unmap before the file goes
    os.remove(tmp_src)
    return res
