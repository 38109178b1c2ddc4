"""`tensorfold calibrate`: the importance matrix of a model on a calibration text.

The text is tokenized and cut into chunks of `ctx` tokens exactly as `tensorfold eval` does
(BOS first where the tokenizer adds one); every chunk runs through the engine's forward pass
as a fresh sequence, and for the input of every weight matrix the engine records, per input
channel j, the sum over tokens of x_j^2 and the number of tokens:

- attention: attn_q/attn_k/attn_v (their common input), attn_output; MLA (deepseek2):
  attn_q or attn_q_a and attn_kv_a_mqa, attn_q_b, and per head attn_k_b (input: the head's
  q_nope) and attn_v_b (input: the head's attention output in latent space); an older file's
  unsplit attn_kv_b gets the normed latent, the input of its expanded form;
- FFN: ffn_gate/ffn_up, ffn_down; MoE: the router ffn_gate_inp, every routed expert of
  ffn_gate_exps/ffn_up_exps/ffn_down_exps separately with the tokens routed to it, shared
  experts (ffn_*_shexp, ffn_gate_inp_shexp);
- the output head: output.weight, or token_embd.weight when the output is tied to it.

The file is llama.cpp's GGUF imatrix format (tools/imatrix/imatrix.cpp), so it is
interchangeable with llama-imatrix's: ``general.type = "imatrix"``, ``imatrix.datasets``,
``imatrix.chunk_count``, ``imatrix.chunk_size``, and per weight ``<name>.in_sum2`` (F32, ne
``[in_dim, n_mat]``: raw sums of squares, not means) and ``<name>.counts`` (F32, ne
``[1, n_mat]``: tokens). n_mat is 1 for a 2-D weight and the number of experts (heads) for a
3-D one. llama.cpp writes the per-head products of a 3-D non-expert weight (MLA's
attn_k_b/attn_v_b) as one row of n_head * in_dim sums with one count; TensorFold writes one
row and one count per head (llama-quantize reads both: the sizes agree). The sha256 of the
text is recorded too (``tensorfold.calibrate.text_sha256``).
"""
from __future__ import annotations

import hashlib
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from . import __version__
from .evaluate import _chunks

SUM2_SUFFIX = ".in_sum2"
COUNTS_SUFFIX = ".counts"
TEXT_SHA256_KEY = "tensorfold.calibrate.text_sha256"
MODEL_KEY = "tensorfold.calibrate.model"
VERSION_KEY = "tensorfold.calibrate.version"


class ImatrixError(ValueError):
    """A file that is not a readable importance matrix; the message says why."""


def missing_module_error(module: str, needed_for: str, extra: str | None = None) -> RuntimeError | None:
    """None when `module` can be imported; else the error that says which package (or extra of
    tensorfold) to install for `needed_for`."""
    import importlib.util

    try:
        if importlib.util.find_spec(module) is not None:
            return None
    except (ImportError, ValueError):  # e.g. sys.modules[module] is None
        pass
    how = (f"the '{extra}' extra: pip install 'tensorfold[{extra}]'" if extra
           else f"the '{module}' package: pip install {module} (a dependency of tensorfold; reinstalling it "
                f"installs it too)")
    return RuntimeError(f"{needed_for} needs {how}")


def check_dependencies() -> None:
    """What `tensorfold calibrate` needs beyond the core, checked before the model loads: the
    gguf package writes the importance matrix."""
    err = missing_module_error("gguf", "tensorfold calibrate (writing the importance matrix)")
    if err is not None:
        raise err


@dataclass
class CalibrationResult:
    path: str | None           # where it was written (None: not written)
    text_tokens: int
    ctx: int
    chunks: int
    tokens: int                # tokens run through the model (chunks * ctx)
    stats: dict                # name -> (sum2 [n_mat, in_dim] float64, counts [n_mat] int64)
    seconds: float
    unused_experts: dict       # name -> how many of its experts no token was routed to


def collect(engine, text: str, *, ctx: int = 512, max_chunks: int | None = None,
            progress: bool = True) -> CalibrationResult:
    """Runs `text` through a loaded tensorfold.Engine (TP=1) in chunks of `ctx` tokens and
    returns the statistics of every weight matrix's input (nothing written)."""
    if not isinstance(text, str):
        raise TypeError(f"text must be str, not {type(text).__name__}")
    if not isinstance(ctx, int) or isinstance(ctx, bool) or ctx < 1:
        raise ValueError(f"ctx must be a positive number of tokens, got {ctx!r}")
    if max_chunks is not None and (not isinstance(max_chunks, int) or max_chunks < 1):
        raise ValueError(f"max_chunks must be a positive number of chunks, got {max_chunks!r}")
    core = engine._native()
    if core.tp_size > 1:
        raise ValueError(f"calibration needs the whole model on one engine: this engine is TP={core.tp_size}; "
                         f"load it with tp=1")
    if ctx > engine.context:
        raise ValueError(f"ctx {ctx} is longer than the engine's context ({engine.context}); load it with a "
                         f"larger context or lower ctx")
    ids = engine.tokenize(text, add_special=False)
    tok = engine.tokenizer
    bos = tok.bos_id if tok.add_bos else None  # as `tensorfold eval` (and llama.cpp) do
    chunks = _chunks(ids, ctx, bos, max_chunks)
    if not chunks:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one chunk of {ctx}; give a longer text "
                         f"or a smaller --ctx")
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(chunks), desc="calibrate", unit="chunk", file=sys.stderr)
    t0 = time.perf_counter()
    # The engine's lock for the whole run: no other request's forward mixes into the statistics.
    with engine._lock:
        core.start_activation_stats()
        stats = None
        try:
            for chunk in chunks:
                core.observe(chunk)
                if bar is not None:
                    bar.update(1)
            stats = core.stop_activation_stats()
        finally:
            if stats is None:  # interrupted or failed: detach, drop what was collected
                core.stop_activation_stats()
            if bar is not None:
                bar.close()
    seconds = time.perf_counter() - t0
    unused = {}
    for name, (sum2, counts) in stats.items():
        if not np.all(np.isfinite(sum2)):
            raise ValueError(f"non-finite activations at the input of {name}: the model overflows on this text "
                             f"(a broken or badly quantized model?)")
        if len(counts) > 1 and (counts == 0).any():
            unused[name] = int((counts == 0).sum())
    return CalibrationResult(path=None, text_tokens=len(ids), ctx=ctx, chunks=len(chunks),
                             tokens=len(chunks) * ctx, stats=stats, seconds=seconds, unused_experts=unused)


def write_imatrix(path: str, stats: dict, *, chunk_count: int, chunk_size: int, datasets: list[str] = (),
                  extra: dict | None = None) -> None:
    """Writes {name: (sum2 [n_mat, in_dim], counts [n_mat])} in llama.cpp's GGUF imatrix format
    (tensors in name order, as llama-imatrix writes them). `extra`: more string metadata."""
    import gguf

    datasets = [str(d) for d in datasets] or ["unknown"]  # llama-quantize wants the key present
    w = gguf.GGUFWriter(path, "")
    # An imatrix has no architecture (llama-imatrix writes none); the writer adds one itself.
    for kv in w.kv_data:
        kv.pop(gguf.Keys.General.ARCHITECTURE, None)
    w.add_type(gguf.GGUFType.IMATRIX)
    w.add_array(gguf.Keys.IMatrix.DATASETS, datasets)
    w.add_uint32(gguf.Keys.IMatrix.CHUNK_COUNT, int(chunk_count))
    w.add_uint32(gguf.Keys.IMatrix.CHUNK_SIZE, int(chunk_size))
    for k, v in (extra or {}).items():
        w.add_string(k, str(v))
    for name in sorted(stats):
        sum2, counts = stats[name]
        sum2 = np.asarray(sum2, dtype=np.float32)
        counts = np.asarray(counts)
        n_mat = counts.size
        if n_mat == 0 or sum2.size == 0 or sum2.size % n_mat:
            raise ValueError(f"{name}: {sum2.size} sums do not split into {n_mat} matrices")
        # numpy shape (n_mat, in_dim) is GGUF ne [in_dim, n_mat]; counts ne [1, n_mat]. Trailing
        # dimensions of 1 are dropped, as ggml writes them ([in_dim] and [1] for a 2-D weight).
        shape2, shape_c = ((-1,), (1,)) if n_mat == 1 else ((n_mat, -1), (n_mat, 1))
        w.add_tensor(name + SUM2_SUFFIX, np.ascontiguousarray(sum2.reshape(shape2)))
        w.add_tensor(name + COUNTS_SUFFIX, counts.astype(np.float32).reshape(shape_c))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def calibrate(model, text_path: str, out_path: str, *, ctx: int = 512, max_chunks: int | None = None,
              threads: int | None = None, progress: bool = True) -> CalibrationResult:
    """`tensorfold calibrate`: loads `model` (path or known name), collects the statistics on
    the text file and writes them to `out_path`."""
    from .engine import Engine
    from .evaluate import read_text

    check_dependencies()
    raw, text = read_text(text_path)
    out_dir = os.path.dirname(os.path.abspath(out_path))
    if not os.path.isdir(out_dir):
        raise ValueError(f"cannot write {out_path}: the directory {out_dir} does not exist")
    with Engine(model, threads=threads, context=ctx, kv_tokens=ctx, prefix_cache=False) as eng:
        res = collect(eng, text, ctx=ctx, max_chunks=max_chunks, progress=progress)
        extra = {TEXT_SHA256_KEY: hashlib.sha256(raw).hexdigest(), MODEL_KEY: os.path.basename(eng.path),
                 VERSION_KEY: __version__}
    tmp = out_path + ".tmp"
    try:
        write_imatrix(tmp, res.stats, chunk_count=res.chunks, chunk_size=ctx, datasets=[text_path], extra=extra)
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    res.path = out_path
    return res


def load_imatrix(path: str, n_mat: dict[str, int] | None = None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Reads an importance matrix in llama.cpp's GGUF format (`tensorfold calibrate` or
    llama-imatrix): {weight name: (sum2 [n_mat, in_dim] float32 sums of squares, counts [n_mat]
    int64 tokens)}, in name order. The mean second moment of input channel j of matrix m is
    sum2[m, j] / counts[m] (counts may be 0 for an expert no token was routed to).

    `n_mat` ({name: matrices}, e.g. a 3-D tensor's shape[2]): llama-imatrix stores a 3-D weight
    it multiplies per head rather than per routed expert (MLA's attn_k_b / attn_v_b) as one row
    of n_head * in_dim sums with one count; such an entry is split into n_mat rows, the count
    repeated. Entries that do not split evenly are left as stored.
    Raises FileNotFoundError, or ImatrixError (a ValueError) for a file that is not one."""
    from .engine import path_error

    path = os.fspath(path)
    err = path_error(path, "importance matrix")
    if err is not None:
        raise err
    if not os.path.exists(path):
        raise FileNotFoundError(f"importance matrix {path} not found")
    if os.path.isdir(path):
        raise ImatrixError(f"{path} is a directory, not an importance matrix file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ImatrixError(
            f"{path} is not a GGUF file (an importance matrix from `tensorfold calibrate` or llama-imatrix is one); "
            f"a legacy llama.cpp .dat imatrix converts with `llama-imatrix --in-file {os.path.basename(path)} "
            f"-o imatrix.gguf`")
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the gguf package raises many kinds on a damaged file
        raise ImatrixError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    field = reader.fields.get(gguf.Keys.General.TYPE)
    gtype = None
    if field is not None:
        try:
            gtype = field.contents()
        except Exception:
            gtype = None
    if gtype is not None and gtype != gguf.GGUFType.IMATRIX:
        raise ImatrixError(f"{path} is a GGUF of type {gtype!r}, not an importance matrix (general.type "
                           f"'imatrix'): make one with `tensorfold calibrate MODEL --text FILE -o {path}`")
    sums, counts = {}, {}
    for t in reader.tensors:
        if t.name.endswith(SUM2_SUFFIX):
            sums[t.name[:-len(SUM2_SUFFIX)]] = t
        elif t.name.endswith(COUNTS_SUFFIX):
            counts[t.name[:-len(COUNTS_SUFFIX)]] = t
    if not sums and not counts:
        what = "a model" if "general.architecture" in reader.fields and gtype is None else "a GGUF"
        raise ImatrixError(f"{path} is {what} without importance data (no '<weight>.in_sum2' tensors): not an "
                           f"importance matrix")
    out = {}
    for name in sorted(set(sums) | set(counts)):
        s, c = sums.get(name), counts.get(name)
        if s is None or c is None:
            raise ImatrixError(f"{path}: {name} has {'sums' if s is not None else 'counts'} but no "
                               f"{'counts' if s is not None else 'sums'}")
        for t in (s, c):
            if t.tensor_type != gguf.GGMLQuantizationType.F32:
                raise ImatrixError(f"{path}: {t.name} is {t.tensor_type.name}; imatrix tensors must be F32")
        cv = np.asarray(c.data, dtype=np.float32).reshape(-1)
        sv = np.asarray(s.data, dtype=np.float32).reshape(-1)
        rows = cv.size
        if rows == 0 or sv.size == 0 or sv.size % rows:
            raise ImatrixError(f"{path}: {name} has {sv.size} sums for {rows} counts (not a whole row each)")
        if not (np.all(np.isfinite(cv)) and np.all(cv >= 0) and np.all(np.isfinite(sv))):
            raise ImatrixError(f"{path}: {name} holds negative or non-finite values")
        cv = np.rint(cv).astype(np.int64)
        want = (n_mat or {}).get(name, rows)
        if rows == 1 and want > 1 and sv.size % want == 0:
            rows, cv = want, np.repeat(cv, want)
        out[name] = (sv.reshape(rows, -1).copy(), cv)
    return out
