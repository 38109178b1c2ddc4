"""TP rank 0 for tests/test_tp_netns.py, run inside a network namespace (`ip netns exec`).

usage: tp_netns_driver.py MODEL PEER RAILS TIMEOUT CONTEXT PROMPTS_JSON [PAUSE_PROMPT PAUSE_AFTER]

Generates 32 greedy tokens for each prompt (a JSON list of token-id lists) with
Engine(tp=2, rank=0). Prints "TOKEN p i" per token. With PAUSE_PROMPT/PAUSE_AFTER it prints
"PAUSED" after that many tokens of that prompt and waits for a line on stdin before going on
(the test takes a rail down meanwhile). Last line: "RESULT <json>" with the tokens, the comm
stats and the seconds each prompt took; on an error "RESULT" carries {"error": ...}.
"""
from __future__ import annotations

import json
import sys
import time

import tensorfold


def main() -> None:
    model, peer, rails, timeout, context = sys.argv[1:6]
    prompts = json.loads(sys.argv[6])
    pause_p, pause_after = (int(sys.argv[7]), int(sys.argv[8])) if len(sys.argv) > 8 else (-1, -1)
    # No prefix cache: a re-run prompt must prefill again (its striped All-Reduces are what the
    # rail tests exercise).
    eng = tensorfold.Engine(model, threads=1, context=int(context), tp=2, rank=0, peer=peer,
                            rails=rails.split(","), timeout=float(timeout), prefix_cache=False)
    out: dict = {"tokens": [], "seconds": []}
    try:
        for p, ids in enumerate(prompts):
            toks: list[int] = []
            t0 = time.monotonic()
            req = eng._request(ids, max_tokens=32, temperature=0.0, top_k=40, top_p=1.0, min_p=0.0,
                               seed=0, ignore_eos=True)
            for _, tok, _, _ in eng._run(req, []):
                if tok is None:
                    continue
                toks.append(tok)
                print(f"TOKEN {p} {len(toks)}", flush=True)
                if p == pause_p and len(toks) == pause_after:
                    print("PAUSED", flush=True)
                    sys.stdin.readline()
                    t0 = time.monotonic()
            out["tokens"].append(toks)
            out["seconds"].append(time.monotonic() - t0)
    except (RuntimeError, ValueError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    try:
        out["comm"] = eng.stats()["comm"]
    except Exception as e:  # noqa: BLE001 - report whatever the group still says
        out["comm_error"] = str(e)
    print("RESULT " + json.dumps(out), flush=True)
    try:
        eng.close()
    except Exception:  # noqa: BLE001
        pass


if __name__ == "__main__":
    main()
