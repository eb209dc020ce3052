"""OpenAI load generator: N streaming clients against /v1/completions (or chat), TTFT / TPOT / ITL.

    python bench/load_gen.py --url http://127.0.0.1:9000 --concurrency 8 --requests 32 \\
        --prompt-tokens 256 --max-tokens 64 --ignore-eos            # closed loop, fixed shape
    python bench/load_gen.py --url ... --rate 2.0 --requests 40 ...   # Poisson arrivals, 2 req/s
    python bench/load_gen.py --url ... --trace bench/traces/mixed.csv  # Azure trace replay

Arrivals: a fixed number of concurrent clients (`--concurrency`), a Poisson process (`--rate`), or
the TIMESTAMP column of an Azure LLM inference trace (`--trace`, ContextTokens / GeneratedTokens
give each request's lengths; `--concurrency` with a trace keeps its lengths but not its times).
Prompts are random single-token words, so a prompt of P tokens is exactly P tokens for the served
model's tokenizer and no two requests share a prefix. Per request: TTFT (first text), TPOT (mean
time per output token after the first, from the usage count), ITL (gaps between streamed chunks).
Prints a table; `--json` prints one JSON line per request then the summary line (what
bench/kpi_slo.py, bench/kpi.py and bench/sweep.py read).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from bench.traces.azure import read_trace  # noqa: E402

DEFAULT_SLO_TPOT_MS = 150.0
PCTS = (50, 90, 99)


@dataclass(frozen=True)
class Spec:
    """One request to send: when (seconds after the start; None = as soon as a client is free), what."""

    index: int
    at: float | None
    prompt_tokens: int
    max_tokens: int


@dataclass
class Result:
    index: int
    prompt_tokens: int
    output_tokens: int = 0
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    start_s: float = 0.0
    error: str | None = None


# ----------------------------------------------------------------------------- prompts


class PromptMaker:
    """Prompts of an exact token count from words that are one token each (after a space)."""

    def __init__(self, tokenizer_path: str | None, seed: int) -> None:
        self.tok, self.words = _vocabulary(tokenizer_path)
        self.rng = random.Random(seed)

    def make(self, n: int) -> str:
        text = "".join(" " + self.rng.choice(self.words) for _ in range(n))
        got = len(self.tok.encode(text))
        if got != n:
            raise RuntimeError(f"prompt maker produced {got} tokens instead of {n}")
        return text


@functools.cache
def _vocabulary(tokenizer_path: str | None) -> tuple[Any, list[str]]:
    """The served model's tokenizer and its lowercase words that are one token after a space."""
    from rngd_pd.frontend.config import FrontendConfig
    from rngd_pd.frontend.served_model import load_served_model

    tok = load_served_model(FrontendConfig(model_path=tokenizer_path)).tokenizer
    vocab = tok.tok.get_vocab()
    words = sorted(
        w[1:]
        for w in vocab
        if w.startswith("Ġ") and w[1:].isascii() and w[1:].isalpha() and 3 <= len(w) <= 9 and w[1:].islower()
    )
    return tok, [w for w in words if len(tok.encode(" " + w)) == 1]


# ----------------------------------------------------------------------------- one request


def _body(args: argparse.Namespace, model: str, prompt: str, max_tokens: int) -> tuple[str, dict]:
    common: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": args.temperature,
    }
    if args.ignore_eos:
        common["ignore_eos"] = True
    if args.endpoint == "chat":
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**common, "prompt": prompt}


def _chunk_text(obj: dict) -> str:
    choices = obj.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    return c.get("text") or (c.get("delta") or {}).get("content") or ""


async def run_one(
    client: httpx.AsyncClient, args: argparse.Namespace, model: str, spec: Spec, prompt: str, t0: float
) -> Result:
    """Send one streaming request and time its chunks."""
    path, body = _body(args, model, prompt, spec.max_tokens)
    res = Result(spec.index, spec.prompt_tokens)
    start = time.perf_counter()
    res.start_s = start - t0
    stamps: list[float] = []
    usage: dict | None = None
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = f"stream error: {obj['error'].get('message', obj['error'])}"[:300]
                    return res
                if _chunk_text(obj):
                    stamps.append(time.perf_counter())
                usage = obj.get("usage") or usage
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:300]
        return res
    end = time.perf_counter()
    res.e2e_ms = 1000 * (end - start)
    res.output_tokens = int(usage["completion_tokens"]) if usage else len(stamps)
    if usage:
        res.prompt_tokens = int(usage.get("prompt_tokens", spec.prompt_tokens))
    if stamps:
        res.ttft_ms = 1000 * (stamps[0] - start)
        res.itl_ms = [1000 * (b - a) for a, b in itertools.pairwise(stamps)]
        if res.output_tokens > 1:
            res.tpot_ms = 1000 * (stamps[-1] - stamps[0]) / (res.output_tokens - 1)
    return res


# ----------------------------------------------------------------------------- schedules


def build_specs(args: argparse.Namespace) -> list[Spec]:
    """The requests of this run, with arrival offsets for open-loop modes."""
    if args.trace:
        rows = read_trace(args.trace, limit=args.requests)
        closed = args.concurrency is not None
        return [
            Spec(i, None if closed else r.t / args.trace_speed, r.context_tokens, r.generated_tokens)
            for i, r in enumerate(rows)
        ]
    n = args.requests
    if args.rate:
        rng, t, times = random.Random(args.seed), 0.0, []
        for _ in range(n):
            times.append(t)
            t += rng.expovariate(args.rate)
        return [Spec(i, times[i], args.prompt_tokens, args.max_tokens) for i in range(n)]
    return [Spec(i, None, args.prompt_tokens, args.max_tokens) for i in range(n)]


async def drive(
    args: argparse.Namespace, specs: list[Spec], prompts: list[str]
) -> tuple[list[Result], float]:
    """Run every spec; returns the results and the wall time from the first send to the last end."""
    width = max(args.concurrency or 0, 1) if all(s.at is None for s in specs) else len(specs)
    limits = httpx.Limits(max_connections=width + 4, max_keepalive_connections=width + 4)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    async with httpx.AsyncClient(
        base_url=args.url, timeout=args.timeout, limits=limits, headers=headers
    ) as client:
        model = args.model or await first_model(client)
        bar = tqdm(total=len(specs), desc="requests", unit="req", file=sys.stderr, disable=args.quiet)
        results: list[Result] = []
        t0 = time.perf_counter()

        async def one(spec: Spec) -> None:
            res = await run_one(client, args, model, spec, prompts[spec.index], t0)
            results.append(res)
            bar.update(1)
            if res.error:
                bar.set_postfix(errors=sum(1 for r in results if r.error))

        if all(s.at is None for s in specs):  # closed loop: `width` clients take the next request
            queue = list(reversed(specs))

            async def client_loop() -> None:
                while queue:
                    await one(queue.pop())

            await asyncio.gather(*(client_loop() for _ in range(width)))
        else:  # open loop: each request at its arrival time, however many are in flight

            async def at(spec: Spec) -> None:
                await asyncio.sleep(max(0.0, (spec.at or 0.0) - (time.perf_counter() - t0)))
                await one(spec)

            await asyncio.gather(*(at(s) for s in specs))
        wall = time.perf_counter() - t0
        bar.close()
    return sorted(results, key=lambda r: r.index), wall


async def first_model(client: httpx.AsyncClient) -> str:
    r = await client.get("/v1/models")
    r.raise_for_status()
    return r.json()["data"][0]["id"]


# ----------------------------------------------------------------------------- statistics


def pct(values: list[float], p: float) -> float | None:
    return round(float(np.percentile(values, p)), 3) if values else None


def summarize(
    results: list[Result], wall_s: float, slo_tpot_ms: float = DEFAULT_SLO_TPOT_MS, **extra: Any
) -> dict[str, Any]:
    """Aggregate figures of one run (the summary JSON line)."""
    ok = [r for r in results if r.error is None]
    out: dict[str, Any] = {
        "type": "summary",
        **extra,
        "requests": len(ok),
        "errors": len(results) - len(ok),
        "duration_s": round(wall_s, 3),
    }
    total_out = sum(r.output_tokens for r in ok)
    out["total_output_tokens"] = total_out
    out["output_tok_s"] = round(total_out / wall_s, 3) if wall_s > 0 else 0.0
    out["mean_prompt_tokens"] = round(float(np.mean([r.prompt_tokens for r in ok])), 1) if ok else None
    out["mean_output_tokens"] = round(float(np.mean([r.output_tokens for r in ok])), 1) if ok else None
    series = {
        "ttft": [r.ttft_ms for r in ok if r.ttft_ms is not None],
        "tpot": [r.tpot_ms for r in ok if r.tpot_ms is not None],
        "itl": [x for r in ok for x in r.itl_ms],
        "e2e": [r.e2e_ms for r in ok if r.e2e_ms is not None],
    }
    for name, values in series.items():
        for p in PCTS:
            out[f"{name}_p{p}_ms"] = pct(values, p)
    out.update(slo_figures(series["tpot"], slo_tpot_ms))
    out["error_samples"] = sorted({r.error for r in results if r.error})[:3]
    return out


def slo_figures(tpots_ms: list[float], slo_tpot_ms: float) -> dict[str, Any]:
    """Share of requests whose TPOT is within the SLO, and whether p99 TPOT meets it (ai-rm's test)."""
    within = sum(1 for t in tpots_ms if t <= slo_tpot_ms)
    p99 = pct(tpots_ms, 99)
    return {
        "slo_tpot_ms": slo_tpot_ms,
        "slo_within": within,
        "slo_share": round(within / len(tpots_ms), 4) if tpots_ms else None,
        "slo_pass": p99 is not None and p99 <= slo_tpot_ms,
    }


def table(summary: dict[str, Any]) -> str:
    """A short human-readable report of a summary."""
    lines = [
        f"requests {summary['requests']} ok, {summary['errors']} errors in {summary['duration_s']} s; "
        f"output {summary['output_tok_s']} tok/s ({summary['total_output_tokens']} tokens)",
        f"{'ms':>6} {'p50':>10} {'p90':>10} {'p99':>10}",
    ]
    for name in ("ttft", "tpot", "itl", "e2e"):
        cells = "".join(
            f"{summary[f'{name}_p{p}_ms'] if summary[f'{name}_p{p}_ms'] is not None else '-':>11}"
            for p in PCTS
        )
        lines.append(f"{name.upper():>6}{cells}")
    share = summary["slo_share"]
    lines.append(
        f"SLO TPOT <= {summary['slo_tpot_ms']} ms: {summary['slo_within']}/{summary['requests']} "
        f"({'-' if share is None else f'{100 * share:.1f}%'}), "
        f"p99 {'PASS' if summary['slo_pass'] else 'FAIL'}"
    )
    for e in summary["error_samples"]:
        lines.append(f"error: {e}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- CLI


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:9000", help="front end base URL (without /v1)")
    ap.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--concurrency", type=int, default=None, help="closed loop with N clients (default 1)")
    mode.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests per second")
    ap.add_argument("--requests", type=int, default=None, help="how many requests (default 4 x concurrency)")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--trace", type=Path, default=None, help="Azure-format CSV (TIMESTAMP,ContextTokens,GeneratedTokens)"
    )
    ap.add_argument("--trace-speed", type=float, default=1.0, help="replay the trace this many times faster")
    ap.add_argument("--ignore-eos", action="store_true", help="ask for exactly max_tokens (server extension)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument(
        "--tokenizer", default=None, help="model path for the prompt tokenizer (default: embedded)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--slo-tpot-ms", type=float, default=DEFAULT_SLO_TPOT_MS)
    ap.add_argument("--json", action="store_true", help="JSON lines: one per request, then the summary")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap


def check_args(args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    if args.concurrency is None and args.rate is None and args.trace is None:
        args.concurrency = 1
    if args.requests is None and args.trace is None:
        args.requests = 4 * (args.concurrency or 1) if args.rate is None else 16
    for name in ("concurrency", "requests", "prompt_tokens", "max_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if (args.rate is not None and args.rate <= 0) or args.trace_speed <= 0:
        ap.error("--rate and --trace-speed must be > 0")


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    check_args(args, ap)
    specs = build_specs(args)
    maker = PromptMaker(args.tokenizer, args.seed)
    prompts = [maker.make(s.prompt_tokens) for s in specs]
    results, wall = asyncio.run(drive(args, specs, prompts))
    mode = "trace" if args.trace else "poisson" if args.rate else "closed"
    summary = summarize(
        results,
        wall,
        args.slo_tpot_ms,
        mode=mode,
        concurrency=args.concurrency,
        rate=args.rate,
        prompt_tokens=None if args.trace else args.prompt_tokens,
        max_tokens=None if args.trace else args.max_tokens,
        trace=str(args.trace) if args.trace else None,
    )
    if args.json:
        for r in results:
            print(json.dumps({"type": "request", **asdict(r)}))
        print(json.dumps(summary), flush=True)
    else:
        print(table(summary))
    return 1 if summary["requests"] == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
