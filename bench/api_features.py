"""What logprobs cost: tokens/s at N concurrent streams with `top_logprobs=5` against the same
requests without logprobs (goal: within 1.1x), through the OpenAI front end.

    .venv/bin/python bench/api_features.py [--url http://HOST:PORT] [--triton-model pd]
                                           [--streams 8] [--max-tokens 64] [--rounds 3]
                                           [--json] [--out FILE]

Each round runs the two variants one after the other (plain, then logprobs; the order alternates by
round so a drifting host load falls on both): `--streams` chat completions at once, streamed, greedy,
EOS ignored, each `--max-tokens` long; tokens/s = all streams' completion tokens over the round's wall
time. The ratio is plain over logprobs (median of the rounds). Without --url a tritonserver (cpu
config, shm) and a front end process are started. The host's load average is recorded beside the
figures: on a shared host they are not quiet-host results.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.frontend_overhead import DEPENDENCIES, frontend, triton  # noqa: E402

PROMPT = "Write a long story about a robot who learns to paint."
VARIANTS = {"plain": {}, "top_logprobs=5": {"logprobs": True, "top_logprobs": 5}}


async def one_stream(client: Any, url: str, model: str, max_tokens: int, extra: dict) -> int:
    """One streamed chat completion; returns its completion tokens (from the usage chunk)."""
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            **extra}
    tokens = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    return tokens


async def one_round(url: str, model: str, streams: int, max_tokens: int, extra: dict) -> dict[str, float]:
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(one_stream(client, url, model, max_tokens, extra)
                                        for _ in range(streams)))
        wall = time.perf_counter() - t0
    return {"tokens": sum(tokens), "wall_s": round(wall, 3), "tok_s": round(sum(tokens) / wall, 2)}


async def served_model(url: str) -> str:
    import httpx

    async with httpx.AsyncClient(timeout=30) as client:
        return (await client.get(url + "/v1/models")).json()["data"][0]["id"]


def measure(args: argparse.Namespace, url: str) -> dict[str, Any]:
    model = asyncio.run(served_model(url))
    asyncio.run(one_round(url, model, args.streams, 8, {}))  # warm-up: graphs, caches, connections
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    for i in range(args.rounds):
        order = list(VARIANTS) if i % 2 == 0 else list(reversed(VARIANTS))
        for name in order:
            rounds[name].append(asyncio.run(one_round(url, model, args.streams, args.max_tokens,
                                                      VARIANTS[name])))
    median = {name: statistics.median(r["tok_s"] for r in rs) for name, rs in rounds.items()}
    return {
        "bench": "api_features",
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "rounds": rounds,
        "median_tok_s": median,
        "slowdown": round(median["plain"] / median["top_logprobs=5"], 3),
        "goal": "slowdown <= 1.1",
        "loadavg": os.getloadavg(),
        "cpus": os.cpu_count(),
        "triton_model": args.triton_model,
    }


def table(row: dict[str, Any]) -> str:
    lines = [f"{row['streams']} streams x {row['max_tokens']} tokens, chat, greedy, streamed "
             f"(load average {', '.join(f'{x:.2f}' for x in row['loadavg'])} on {row['cpus']} CPUs)",
             f"{'variant':<16} {'tokens/s (median)':>18}  rounds"]
    for name, value in row["median_tok_s"].items():
        per_round = ", ".join(f"{r['tok_s']:.1f}" for r in row["rounds"][name])
        lines.append(f"{name:<16} {value:>18.1f}  {per_round}")
    lines.append(f"slowdown with top_logprobs=5: {row['slowdown']:.3f}x (goal <= 1.1x)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=None, help="a running front end (default: start Triton and one)")
    ap.add_argument("--triton-model", choices=sorted(DEPENDENCIES), default="pd")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            grpc_url = stack.enter_context(triton(args.triton_model))
            url, _ = stack.enter_context(frontend(grpc_url, args.triton_model))
        row = measure(args, url)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(row, indent=1) + "\n")
    print(json.dumps(row) if args.json else table(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
