"""Throughput with a JSON schema on every request against the same load unconstrained.

N concurrent streams (default 8), each `--max-tokens` tokens past EOS (`ignore_eos`); the schema asks
for an array of at least `--min-items` small integers, so its grammar never ends a request before
max_tokens and both runs generate the same number of tokens: the difference is the cost of the token
masks (computed on the decode-grammar thread while the step runs) and of sampling constrained rows one
by one. Rounds alternate unconstrained / schema, and the ratio of the medians is the result (the bar
is 1.2: constrained tokens/s at least 1/1.2 of unconstrained).

    # in process: prefill + decode engines (ColocatedEngine), no server
    .venv/bin/python bench/structured_bench.py --streams 8 --rounds 3 --out bench/results/NAME/
    # served: through a running front end (rngd-pd serve), streamed with the openai SDK
    .venv/bin/python bench/structured_bench.py --url http://127.0.0.1:9000 --streams 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROMPT = "List some numbers as JSON."
HOST_US: dict[bool, list[float]] = {False: [], True: []}  # in process: decode host µs per token, by run


def schema(min_items: int) -> dict[str, Any]:
    return {"type": "object", "required": ["numbers"], "additionalProperties": False,
            "properties": {"numbers": {"type": "array", "minItems": min_items,
                                       "items": {"type": "integer", "minimum": 0, "maximum": 999}}}}


def concurrently(n: int, one: Callable[[int], int]) -> tuple[int, float]:
    """Run one(i) on n threads at once; (total tokens, wall seconds)."""
    counts = [0] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            counts[i] = one(i)
        except BaseException as exc:  # reported after the join
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return sum(counts), time.perf_counter() - t0


def in_process(args: argparse.Namespace) -> Callable[[bool], tuple[int, float]]:
    import torch

    from rngd_pd.engine.colocated import ColocatedEngine
    from rngd_pd.model import load_model
    from rngd_pd.model.sampling import SamplingParams
    from rngd_pd.model.structured import Structured

    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(progress=False)
    tok = loaded.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]))
    # its decode scheduler runs from here until the process ends
    eng = ColocatedEngine(loaded, num_slots=args.streams, max_len=len(ids) + args.max_tokens + 8)
    structured = Structured("json_schema", schema(args.min_items)).to_json()

    def round_(constrained: bool) -> tuple[int, float]:
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=args.temperature,
                                seed=1, structured=structured if constrained else None)
        before = eng.decode_engine.stats()
        result = concurrently(args.streams, lambda i: len(eng.generate(ids, params).token_ids))
        after = eng.decode_engine.stats()
        # the scheduler's own time per token outside the model (sampling, masks, emitting): less
        # sensitive to a loaded host than the wall clock
        HOST_US[constrained].append((after["host_s"] - before["host_s"]) * 1e6 /
                                    max(1, after["tokens"] - before["tokens"]))
        return result

    return round_


def served(args: argparse.Namespace) -> Callable[[bool], tuple[int, float]]:
    import openai

    client = openai.OpenAI(base_url=args.url.rstrip("/") + "/v1", api_key=args.api_key, max_retries=0,
                           timeout=600)
    model = client.models.list().data[0].id
    fmt = {"type": "json_schema", "json_schema": {"name": "numbers", "schema": schema(args.min_items)}}

    def one(constrained: bool) -> int:
        extra = {"response_format": fmt} if constrained else {}
        usage = None
        for chunk in client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=args.max_tokens,
                temperature=args.temperature, seed=1, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True}, **extra):
            usage = chunk.usage or usage
        return usage.completion_tokens if usage else 0

    return lambda constrained: concurrently(args.streams, lambda i: one(constrained))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running front end; without it, the engines run in this process")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--min-items", type=int, default=48, help="the schema's minItems (keeps it going)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads in process (0 = default)")
    ap.add_argument("--out", type=Path, help="a results folder: structured.json and the load average")
    ap.add_argument("--host-note", default="", help="written beside the figures (e.g. 'loaded host')")
    args = ap.parse_args(argv)
    run = served(args) if args.url else in_process(args)
    run(False), run(True)  # warm-up: graphs, the grammar compiled and cached
    rows = []
    for r in range(args.rounds):
        for constrained in (False, True):
            tokens, wall = run(constrained)
            rows.append({"round": r, "schema": constrained, "tokens": tokens, "s": round(wall, 3),
                         "tok_s": round(tokens / wall, 1)})
            print(f"round {r}  {'schema' if constrained else 'free  '}  {tokens:5d} tokens  "
                  f"{wall:7.2f} s  {tokens / wall:7.1f} tok/s", flush=True)
    free = statistics.median(x["tok_s"] for x in rows if not x["schema"])
    constrained_tok_s = statistics.median(x["tok_s"] for x in rows if x["schema"])
    ratio = free / constrained_tok_s
    summary = {"mode": "served" if args.url else "in_process", "streams": args.streams,
               "max_tokens": args.max_tokens, "temperature": args.temperature, "free_tok_s": free,
               "schema_tok_s": constrained_tok_s, "slowdown": round(ratio, 3), "bar": 1.2,
               "pass": ratio <= 1.2, "loadavg": os.getloadavg(), "host_note": args.host_note,
               "rows": rows}
    if HOST_US[True]:
        summary["decode_host_us_per_token"] = {"free": round(statistics.median(HOST_US[False]), 1),
                                               "schema": round(statistics.median(HOST_US[True]), 1)}
        print(f"decode scheduler outside the model, per token: {summary['decode_host_us_per_token']} µs")
    print(f"unconstrained {free:.1f} tok/s, schema {constrained_tok_s:.1f} tok/s: "
          f"{ratio:.3f}x slower (bar 1.2x) -> {'PASS' if ratio <= 1.2 else 'FAIL'}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "structured.json").write_text(json.dumps(summary, indent=1) + "\n")
        print(f"wrote {args.out / 'structured.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
