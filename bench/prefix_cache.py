#!/usr/bin/env python3
"""Second chat turn's time to first token with and without the prefix cache.

    python bench/prefix_cache.py [--model PATH] [--threads 2] [--first-turn 1500] [--reps 3]

A first turn of about --first-turn tokens (system prompt + a long user message, chat template
applied) is answered (--reply tokens, greedy); then the second turn (the first, the reply and
a short new question) is sent and the time from add_request to its first token is measured,
once on an engine with the prefix cache and once on one without (same options otherwise).
Each repetition asks a different second question; the median is reported, with the ratio
cached / uncached and the prompt tokens each prefilled. Both engines must give the same
second-turn tokens (checked).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def first_token(core, ids, n_gen):
    """Seconds from add_request to the first token, and all tokens (greedy)."""
    t0 = time.perf_counter()
    rid = core.add_request(ids, max_tokens=n_gen, temperature=0.0, ignore_eos=True)
    ttft, toks = None, []
    while core.has_unfinished():
        for e in core.step():
            if e[0] == rid:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                toks.append(e[1])
    return ttft, toks


def main() -> None:
    import tensorfold

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--first-turn", type=int, default=1500, help="approximate first-turn prompt tokens")
    ap.add_argument("--reply", type=int, default=32, help="first-turn reply tokens")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args()
    model = a.model or tensorfold.pull("smollm2-135m-instruct")
    engines = {name: tensorfold.Engine(model, threads=a.threads, context=a.first_turn + 512, prefix_cache=on)
               for name, on in (("cached", True), ("uncached", False))}
    eng = engines["cached"]
    para = ("The harbour town wakes before dawn: fishing boats slip out past the lighthouse, the baker "
            "lights the ovens, and gulls argue over the quay while the tide turns. ")
    system = {"role": "system", "content": "You are a helpful assistant who answers concisely."}
    text = para
    while len(eng._prompt_ids(None, [system, {"role": "user", "content": text + para}])) <= a.first_turn:
        text += para
    turn1 = [system, {"role": "user", "content": text + "Summarise this in one sentence."}]
    ids1 = eng._prompt_ids(None, turn1)
    questions = ["What does the baker do?", "Name one bird in the text.", "When do the boats leave?",
                 "What turns while the gulls argue?", "Is there a lighthouse?"]
    res = {}
    replies = {}
    for name, e in engines.items():
        _, reply = first_token(e._core, ids1, a.reply)
        replies[name] = reply
        times, prefilled, outs = [], [], []
        for r in range(a.reps):
            turn2 = turn1 + [{"role": "assistant", "content": e.detokenize(reply)},
                             {"role": "user", "content": questions[r % len(questions)]}]
            ids2 = e._prompt_ids(None, turn2)
            before = e.stats()["prompt_tokens"]
            ttft, toks = first_token(e._core, ids2, 8)
            times.append(ttft)
            prefilled.append(e.stats()["prompt_tokens"] - before)
            outs.append(toks)
        st = e.stats()
        res[name] = {"ttft_s": statistics.median(times), "all_ttft_s": times, "second_turn_tokens": len(ids2),
                     "prefilled_tokens": prefilled, "outputs": outs, "prefix_cache_hits": st["prefix_cache_hits"]}
    assert replies["cached"] == replies["uncached"], "first-turn replies differ"
    assert res["cached"]["outputs"] == res["uncached"]["outputs"], "second-turn tokens differ"
    out = {"model": model, "threads": a.threads, "first_turn_tokens": len(ids1),
           "second_turn_tokens": res["cached"]["second_turn_tokens"],
           "ttft_cached_s": res["cached"]["ttft_s"], "ttft_uncached_s": res["uncached"]["ttft_s"],
           "ratio": res["cached"]["ttft_s"] / res["uncached"]["ttft_s"],
           "prefilled_cached": res["cached"]["prefilled_tokens"],
           "prefilled_uncached": res["uncached"]["prefilled_tokens"],
           "all_ttft_cached_s": res["cached"]["all_ttft_s"], "all_ttft_uncached_s": res["uncached"]["all_ttft_s"]}
    if a.json:
        print(json.dumps(out))
        return
    print(f"first turn {out['first_turn_tokens']} tokens, second turn {out['second_turn_tokens']} tokens, "
          f"{a.threads} threads, median of {a.reps}")
    print(f"second-turn TTFT without cache: {out['ttft_uncached_s'] * 1e3:8.1f} ms "
          f"(prefilled {out['prefilled_uncached']} tokens)")
    print(f"second-turn TTFT with cache:    {out['ttft_cached_s'] * 1e3:8.1f} ms "
          f"(prefilled {out['prefilled_cached']} tokens)")
    print(f"ratio cached / uncached:        {out['ratio']:8.3f}")


if __name__ == "__main__":
    main()
