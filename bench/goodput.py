"""Goodput under SLO: the highest open-loop request rate at which at least 90 % of requests meet both a
TTFT and a TPOT objective (DistServe's measure), for rngd-pd and vLLM CPU on the same host, one after the
other, with the same arrivals and prompts.

    python bench/goodput.py                                   # the mix below, rngd-pd and vLLM, 0.25..1 req/s
    python bench/goodput.py --mix 128:0.7,512:0.2,1536:0.1 --rates 0.25,0.5,0.75,1 --bisect 3
    python bench/goodput.py --workload chat --turns 4         # multi-turn chat, histories shared
    python bench/goodput.py --workload summarize              # long prompts, short answers
    python bench/goodput.py --ttft-ms 2000 --ttft-ms-per-token 4 --tpot-ms 150
    python bench/goodput.py --systems pd --attach pd=http://127.0.0.1:9000   # a running front end
    python bench/goodput.py --rescore before=runA,after=runB --tpot-ms 150   # earlier runs, rescored
    python bench/goodput.py --aiperf 0.5                      # + NVIDIA aiperf's request-rate mode at 0.5

A request meets the objective when it succeeds, its TTFT <= max(--ttft-ms, --ttft-ms-per-token x its
prompt tokens) and its TPOT <= --tpot-ms. Attainment at a rate = the share of the run's requests that meet
it. The run replays the same unit-rate Poisson arrivals (seeded) scaled to each rate, so every rate and
every system sees the same requests in the same order; after the sweep, `--bisect N` halves the interval
between the highest rate that met --attainment and the lowest that did not, N times, per system.
Workloads: `mix` (unique prompts whose lengths follow --mix), `chat` (conversations whose every turn
resends the history plus a new user message: prefixes shared, as a chat client does), `summarize` (long
prompts, short outputs). Output tokens are --max-tokens with EOS ignored. Every point (and the warm-up)
salts its prompts' first word, so no point reuses another's prefixes from a server's prefix cache.

`--aiperf RATE` checks one point with a second client: after each system's sweep, NVIDIA's aiperf
(request-rate mode, its own Poisson arrivals and prompts, the mix as its --seq-dist) sends as many
requests at RATE, and its per-request records are scored against the same objective; the table gives
its attainment beside the load generator's at that rate, the plot marks it.

Prints a table; writes goodput.json (every point and request), goodput.png (attainment against rate per
system) and the servers' logs under --out. A speed run runs alone: nothing else on the machine; the load
average is recorded in every point.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(ROOT))

from bench import load_gen, sweep  # noqa: E402
from bench.peers import aiperf, vllm  # noqa: E402

SYSTEMS = ("pd", "vllm")
DEFAULT_MIX = "128:0.7,512:0.2,1536:0.1"
SUMMARIZE_MIX = "1024:0.5,2048:0.5"


# ----------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Request:
    """One request of a workload: its arrival at rate 1 (seconds), its prompt and output lengths."""

    index: int
    unit_at: float
    prompt: str
    prompt_tokens: int
    max_tokens: int
    conversation: int | None = None
    turn: int | None = None


def parse_mix(text: str) -> list[tuple[int, float]]:
    """`128:0.7,512:0.2,1536:0.1` -> [(128, 0.7), ...]; weights are normalised."""
    pairs = []
    for part in text.split(","):
        tokens, _, weight = part.partition(":")
        pairs.append((int(tokens), float(weight or 1)))
    total = sum(w for _, w in pairs)
    if not pairs or total <= 0 or any(t < 1 or w < 0 for t, w in pairs):
        raise ValueError(f"--mix wants TOKENS:WEIGHT,... with tokens >= 1 and weights >= 0, got {text!r}")
    return [(t, w / total) for t, w in pairs]


def unit_arrivals(n: int, seed: int) -> list[float]:
    """Poisson arrivals at 1 request/s; the arrivals at rate r are these divided by r."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(1.0)
    return out


def mix_workload(
    n: int, mix: Sequence[tuple[int, float]], max_tokens: int, make: Callable[[int], str], seed: int
) -> list[Request]:
    """n unique prompts whose lengths are drawn from the mix (exact counts: round(n x weight))."""
    lengths: list[int] = []
    for tokens, weight in mix:
        lengths += [tokens] * round(n * weight)
    lengths = (lengths + [mix[0][0]] * n)[:n]
    random.Random(seed).shuffle(lengths)
    arrivals = unit_arrivals(n, seed)
    return [Request(i, arrivals[i], make(p), p, max_tokens) for i, p in enumerate(lengths)]


def chat_workload(
    conversations: int, turns: int, system_tokens: int, user_tokens: int, answer_tokens: int,
    max_tokens: int, make: Callable[[int], str], seed: int,
) -> list[Request]:
    """Multi-turn chats: turn k resends the system prompt, every earlier user message and a stand-in for
    each earlier answer, then a new user message; turn k of a conversation arrives after its turn k-1.
    Each conversation has its own system prompt (no prefix shared across conversations)."""
    rng = random.Random(seed)
    left = {c: turns for c in range(conversations)}
    history = {c: (make(system_tokens), system_tokens) for c in range(conversations)}
    arrivals = unit_arrivals(conversations * turns, seed)
    out: list[Request] = []
    for i, at in enumerate(arrivals):
        c = rng.choice(sorted(k for k, v in left.items() if v))
        turn = turns - left[c]
        left[c] -= 1
        text, count = history[c]
        text, count = text + make(user_tokens), count + user_tokens
        out.append(Request(i, at, text, count, max_tokens, conversation=c, turn=turn))
        history[c] = (text + make(answer_tokens), count + answer_tokens)
    return out


# ----------------------------------------------------------------------------- objective


@dataclass(frozen=True)
class Objective:
    """TTFT <= max(ttft_ms, ttft_ms_per_token x prompt tokens) and TPOT <= tpot_ms."""

    ttft_ms: float = 1000.0
    ttft_ms_per_token: float = 2.0
    tpot_ms: float = 100.0

    def ttft_limit_ms(self, prompt_tokens: int) -> float:
        return max(self.ttft_ms, self.ttft_ms_per_token * prompt_tokens)

    def met(self, r: load_gen.Result) -> bool:
        if r.error is not None or r.ttft_ms is None:
            return False
        tpot_ok = r.tpot_ms is None or r.tpot_ms <= self.tpot_ms  # one output token: no TPOT to miss
        return r.ttft_ms <= self.ttft_limit_ms(r.prompt_tokens) and tpot_ok

    def __str__(self) -> str:
        return (f"TTFT <= max({self.ttft_ms:g} ms, {self.ttft_ms_per_token:g} ms x prompt tokens), "
                f"TPOT <= {self.tpot_ms:g} ms")


def point_row(system: str, rate: float, results: list[load_gen.Result], wall_s: float,
              objective: Objective) -> dict[str, Any]:
    """Attainment and latency percentiles of one run at one rate."""
    ok = [r for r in results if r.error is None]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    tpot = [r.tpot_ms for r in ok if r.tpot_ms is not None]
    met = sum(objective.met(r) for r in results)
    out_tokens = sum(r.output_tokens for r in ok)
    starts = sorted(r.start_s for r in results)
    span = starts[-1] - starts[0] if starts else 0.0
    return {
        "system": system,
        "rate": rate,
        # what the arrivals gave: 40 Poisson arrivals landed 18-26 % off the rate asked (2026-12-07)
        "realized_rate": round((len(starts) - 1) / span, 4) if span > 0 else None,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "attainment": round(met / len(results), 4) if results else 0.0,
        "ttft_p50_ms": load_gen.pct(ttft, 50), "ttft_p90_ms": load_gen.pct(ttft, 90),
        "tpot_p50_ms": load_gen.pct(tpot, 50), "tpot_p90_ms": load_gen.pct(tpot, 90),
        "output_tok_s": round(out_tokens / wall_s, 2) if wall_s > 0 else None,
        "wall_s": round(wall_s, 2),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def goodput(points: Sequence[dict[str, Any]], target: float) -> float:
    """The highest rate whose attainment >= target, below which every measured rate met it too
    (a rate that passes above a failing one is luck, not capacity); 0.0 when the lowest fails."""
    best = 0.0
    for p in sorted(points, key=lambda p: p["rate"]):
        if p["attainment"] < target:
            break
        best = p["rate"]
    return best


def next_bisection(points: Sequence[dict[str, Any]], target: float) -> float | None:
    """The midpoint between the goodput and the lowest rate above it that failed (None: nothing to split)."""
    good = goodput(points, target)
    above = [p["rate"] for p in points if p["rate"] > good and p["attainment"] < target]
    if not above:
        return None
    return round((good + min(above)) / 2, 4) if good > 0 else round(min(above) / 2, 4)


# ----------------------------------------------------------------------------- running


async def replay(url: str, model: str, requests: Sequence[Request], rate: float,
                 timeout: float) -> tuple[list[load_gen.Result], float]:
    """Send every request at unit_at / rate (open loop), streamed, EOS ignored, greedy."""
    args = argparse.Namespace(endpoint="completions", ignore_eos=True, temperature=0.0,
                              api_key=None, timeout=timeout)
    import httpx

    limits = httpx.Limits(max_connections=len(requests) + 4, max_keepalive_connections=len(requests) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()

        async def at(r: Request) -> load_gen.Result:
            await asyncio.sleep(max(0.0, r.unit_at / rate - (time.perf_counter() - t0)))
            spec = load_gen.Spec(r.index, r.unit_at / rate, r.prompt_tokens, r.max_tokens)
            return await load_gen.run_one(client, args, model, spec, r.prompt, t0)

        results = await asyncio.gather(*(at(r) for r in requests))
        return list(results), time.perf_counter() - t0


def salted(requests: Sequence[Request], point: int) -> list[Request]:
    """The requests with their first word replaced by point `point`'s own word (one token, like the
    word it replaces, so every length holds). Each point replays the same requests, and a server with
    a prefix cache (rngd-pd's and vLLM's are on by default) would serve every point after the first
    from the KV the earlier ones left; salted, no prompt shares even its first block with another
    point's, while a chat's turns still share their conversation's history within the point."""
    words = _salt_words()
    word = words[point % len(words)]
    return [replace(r, prompt=" " + word + _after_first_word(r.prompt)) for r in requests]


def _after_first_word(prompt: str) -> str:
    """What follows a prompt's first word (" w1 w2 w3" -> " w2 w3"; a one-word prompt -> "")."""
    cut = prompt.find(" ", 1)
    return "" if cut < 0 else prompt[cut:]


@functools.cache
def _salt_words() -> tuple[str, ...]:
    words = list(load_gen._vocabulary(None)[1])
    random.Random(20261207).shuffle(words)
    return tuple(words)


def warm(url: str, model: str, requests: Sequence[Request], timeout: float) -> None:
    """One request of each prompt length (shortest first), one at a time, before any measured point
    (salted as point 0: nothing of it is reused by the measured points)."""
    seen: dict[int, Request] = {}
    for r in salted(requests, 0):
        seen.setdefault(r.prompt_tokens, r)
    for i, (n, r) in enumerate(sorted(seen.items())):
        warm_req = Request(i, 0.0, r.prompt + " warm", n + 1, 4)
        asyncio.run(replay(url, model, [warm_req], 1.0, timeout))


def measure_system(url: str, system: str, requests: Sequence[Request], a: argparse.Namespace,
                   objective: Objective, sink: Any) -> list[dict[str, Any]]:
    """Every rate of --rates, then --bisect midpoints; each point's row is written to sink at once."""
    model = sweep._model_id(url)
    warm(url, model, requests, a.timeout)
    points: list[dict[str, Any]] = []

    def run_at(rate: float) -> None:
        batch = salted(requests, len(points) + 1)  # unique to this point (0 is the warm-up)
        results, wall = asyncio.run(replay(url, model, batch, rate, a.timeout))
        row = point_row(system, rate, results, wall, objective)
        log(f"{system:>5} {rate:6.3f} req/s: attainment {row['attainment']:.2f}, TTFT p50/p90 "
            f"{row['ttft_p50_ms']}/{row['ttft_p90_ms']} ms, TPOT p50/p90 {row['tpot_p50_ms']}/"
            f"{row['tpot_p90_ms']} ms, errors {row['errors']}")
        points.append(row)
        sink.write(json.dumps({**row, "results": [asdict(r) for r in results]}) + "\n")
        sink.flush()

    for rate in a.rates:
        run_at(rate)
    for _ in range(a.bisect):
        mid = next_bisection(points, a.attainment)
        if mid is None or any(abs(p["rate"] - mid) < 1e-6 for p in points):
            break
        run_at(mid)
    return points


def seq_dist(mix: Sequence[tuple[int, float]], max_tokens: int) -> str:
    """The mix as aiperf's --seq-dist (`ISL,OSL:PERCENT;...`, whole percents summing to 100)."""
    pct = [round(w * 100) for _, w in mix]
    pct[pct.index(max(pct))] += 100 - sum(pct)
    return ";".join(f"{t},{max_tokens}:{p}" for (t, _), p in zip(mix, pct, strict=True) if p > 0)


def aiperf_results(artifacts: Path) -> tuple[list[load_gen.Result], float]:
    """aiperf's per-request records as load_gen results (its ITL is load_gen's TPOT), scored alike,
    and the seconds from the first request's start to the last one's end."""
    records = aiperf.read_records(artifacts)
    first = records[0]["start_ns"] if records else 0
    results = [load_gen.Result(i, r["prompt_tokens"], r["output_tokens"], r["ttft_ms"], r["tpot_ms"],
                               r["e2e_ms"], start_s=(r["start_ns"] - first) / 1e9, error=r["error"])
               for i, r in enumerate(records)]
    ends = [(r["start_ns"] - first) / 1e9 + (r["e2e_ms"] or 0) / 1000 for r in records]
    return results, max(ends, default=0.0)


def measure_aiperf(url: str, system: str, a: argparse.Namespace, objective: Objective) -> dict[str, Any]:
    """One point by NVIDIA's aiperf in its request-rate mode (its own Poisson arrivals and prompts, the
    mix as --seq-dist, EOS ignored) against the server the sweep just measured, scored against the
    same objective from aiperf's per-request records: the load generator's figure at that rate, checked
    by a client the field uses."""
    artifacts = a.out / f"aiperf-{system}"
    argv = aiperf.profile_argv(url, sweep._model_id(url), tokenizer=vllm.write_hf_copy(sweep.embedded_gguf()),
                               concurrency=0, requests=a.requests, prompt_tokens=0, max_tokens=a.max_tokens,
                               artifacts=artifacts, request_rate=a.aiperf,
                               seq_dist=seq_dist(parse_mix(a.mix), a.max_tokens), seed=a.seed)
    with (a.out / f"aiperf-{system}.log").open("wb") as logf:
        proc = subprocess.run(argv, stdout=logf, stderr=subprocess.STDOUT, check=False,
                              timeout=a.timeout + a.requests / a.aiperf * 3,
                              env=aiperf.environment(dict(os.environ)))
    results, wall = aiperf_results(artifacts)
    if not results:
        raise RuntimeError(f"aiperf exited {proc.returncode} with no records: {a.out}/aiperf-{system}.log")
    row = {**point_row(system, a.aiperf, results, wall, objective), "client": "aiperf"}
    log(f"{system:>5} {a.aiperf:6.3f} req/s by aiperf: attainment {row['attainment']:.2f}, TTFT p50/p90 "
        f"{row['ttft_p50_ms']}/{row['ttft_p90_ms']} ms, TPOT p50/p90 {row['tpot_p50_ms']}/"
        f"{row['tpot_p90_ms']} ms")
    return row


def start_system(system: str, a: argparse.Namespace, stack: ExitStack) -> str:
    """The base URL of a running `system`, started through bench/sweep.py's launchers (or attached)."""
    if system in a.attached:
        return a.attached[system]
    slots = a.num_slots if system == "vllm" else a.pd_num_slots
    sa = sweep.parse_args(["--systems", system, "--num-slots", str(slots), "--out", str(a.out),
                           "--prompt-tokens", str(max(r.prompt_tokens for r in a.requests_)),
                           "--max-tokens", str(a.max_tokens), "--trace", "",
                           *(f"--serve-arg={arg}" for arg in a.serve_arg)])
    ctx = sweep.rngd_stack([system], sa, a.out) if system == "pd" else sweep.peer(system, sa, a.out)
    return stack.enter_context(ctx)[0].url


# ----------------------------------------------------------------------------- report


def table(points: Sequence[dict[str, Any]], target: float, checks: Sequence[dict[str, Any]] = ()) -> str:
    lines = ["| system | rate (req/s) | realized | attainment | TTFT p50 / p90 ms | TPOT p50 / p90 ms "
             "| errors | load |", "|---|---|---|---|---|---|---|---|"]
    for p in sorted(points, key=lambda p: (p["system"], p["rate"])):
        lines.append(f"| {p['system']} | {p['rate']:g} | {p.get('realized_rate')} | {p['attainment']:.2f} | "
                     f"{p['ttft_p50_ms']} / "
                     f"{p['ttft_p90_ms']} | {p['tpot_p50_ms']} / {p['tpot_p90_ms']} | {p['errors']} | "
                     f"{p['loadavg_1m']} |")
    by_system: dict[str, list[dict[str, Any]]] = {}
    for p in points:
        by_system.setdefault(p["system"], []).append(p)
    good = {s: goodput(ps, target) for s, ps in by_system.items()}
    lines.append("")
    lines += [f"goodput ({target:.0%} within the objective) {s}: {g:g} req/s" for s, g in good.items()]
    if good.get("vllm"):
        lines.append(f"goodput pd / vllm: {good.get('pd', 0.0) / good['vllm']:.2f}x")
    for c in checks:
        same = [p for p in points if p["system"] == c["system"] and abs(p["rate"] - c["rate"]) < 1e-6]
        head = f"aiperf {c['system']} at {c['rate']:g} req/s (realized {c.get('realized_rate')}): attainment"
        lines.append(f"{head} {c['attainment']:.2f}" + (f" (load_gen {same[0]['attainment']:.2f}, realized "
                                                        f"{same[0].get('realized_rate')})" if same else ""))
        lines[-1] += (f", TTFT p50/p90 {c['ttft_p50_ms']}/{c['ttft_p90_ms']} ms, TPOT p50/p90 "
                      f"{c['tpot_p50_ms']}/{c['tpot_p90_ms']} ms, errors {c['errors']}")
    return "\n".join(lines)


def plot(points: Sequence[dict[str, Any]], target: float, title: str, path: Path,
         checks: Sequence[dict[str, Any]] = ()) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system in sorted({p["system"] for p in points}):
        ps = sorted((p for p in points if p["system"] == system), key=lambda p: p["rate"])
        ax.plot([p["rate"] for p in ps], [p["attainment"] for p in ps], marker="o",
                label=f"{system} (goodput {goodput(ps, target):g} req/s)")
    for c in checks:
        ax.plot([c["rate"]], [c["attainment"]], marker="x", markersize=10, linestyle="none",
                label=f"{c['system']} by aiperf")
    ax.axhline(target, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("request rate (req/s, Poisson)")
    ax.set_ylabel("share of requests within the objective")
    ax.set_ylim(0, 1.02)
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def log(msg: str) -> None:
    print(f"[goodput {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- command line


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    floats = lambda s: [float(x) for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="pd and/or vllm")
    ap.add_argument("--attach", default="", help="SYSTEM=URL,...: running servers instead of starting them")
    ap.add_argument("--workload", choices=("mix", "chat", "summarize"), default="mix")
    ap.add_argument("--mix", default=None, help=f"TOKENS:WEIGHT,... (mix default {DEFAULT_MIX}; "
                    f"summarize {SUMMARIZE_MIX})")
    ap.add_argument("--requests", type=int, default=60, help="requests per point (mix, summarize)")
    ap.add_argument("--conversations", type=int, default=12, help="chat: conversations")
    ap.add_argument("--turns", type=int, default=5, help="chat: turns per conversation")
    ap.add_argument("--system-tokens", type=int, default=256, help="chat: each conversation's system prompt")
    ap.add_argument("--user-tokens", type=int, default=64, help="chat: tokens per user message")
    ap.add_argument("--answer-tokens", type=int, default=64, help="chat: tokens of each earlier answer")
    ap.add_argument("--max-tokens", type=int, default=None, help="output tokens (mix/chat 64, summarize 32)")
    ap.add_argument("--rates", type=floats, default=[0.25, 0.5, 0.75, 1.0])
    ap.add_argument("--bisect", type=int, default=2, help="bisection steps after the sweep, per system")
    ap.add_argument("--attainment", type=float, default=0.9)
    ap.add_argument("--ttft-ms", type=float, default=1000.0)
    ap.add_argument("--ttft-ms-per-token", type=float, default=2.0)
    ap.add_argument("--tpot-ms", type=float, default=100.0)
    ap.add_argument("--num-slots", type=int, default=32, help="vLLM's max_num_seqs")
    ap.add_argument("--pd-num-slots", type=int, default=0, help="pd's decode slots (0: what serve sizes)")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `rngd-pd serve` argument")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--aiperf", type=float, default=0.0, metavar="RATE",
                    help="also run NVIDIA aiperf's request-rate mode at RATE against each system (mix and "
                         "summarize workloads; its own venv, bench/peers/aiperf.py)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    out = ROOT / "bench" / "out" / time.strftime("goodput-%Y%m%d-%H%M%S")
    ap.add_argument("--out", type=Path, default=out)
    ap.add_argument("--rescore", type=lambda t: [x for x in t.split(",") if x], default=[],
                    help="[LABEL=]DIR,...: score earlier runs' points.jsonl against this objective, each "
                         "under LABEL (no servers)")
    a = ap.parse_args(argv)
    a.systems = [s for s in a.systems.split(",") if s]
    if set(a.systems) - set(SYSTEMS):
        ap.error(f"--systems: choose from {','.join(SYSTEMS)}")
    a.attached = dict(kv.split("=", 1) for kv in a.attach.split(",") if kv)
    if a.max_tokens is None:
        a.max_tokens = 32 if a.workload == "summarize" else 64
    a.mix = a.mix or (SUMMARIZE_MIX if a.workload == "summarize" else DEFAULT_MIX)
    if not a.rates or min(a.rates) <= 0 or not 0 < a.attainment <= 1:
        ap.error("--rates must be > 0 and --attainment in (0, 1]")
    if a.aiperf < 0 or (a.aiperf and a.workload == "chat"):
        ap.error("--aiperf RATE: a rate > 0, for the mix and summarize workloads (aiperf draws its own "
                 "prompts)")
    return a


def build_requests(a: argparse.Namespace) -> list[Request]:
    make = load_gen.PromptMaker(None, a.seed).make
    if a.workload == "chat":
        return chat_workload(a.conversations, a.turns, a.system_tokens, a.user_tokens, a.answer_tokens,
                             a.max_tokens, make, a.seed)
    return mix_workload(a.requests, parse_mix(a.mix), a.max_tokens, make, a.seed)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    a.requests_ = build_requests(a)
    objective = Objective(a.ttft_ms, a.ttft_ms_per_token, a.tpot_ms)
    log(f"{a.workload}: {len(a.requests_)} requests a point; objective {objective}; "
        f"load average {os.getloadavg()[0]:.2f}")
    points: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []  # aiperf's points: reported beside the sweep, not in its goodput
    if a.rescore:
        points = rescore(a.rescore, objective)
        a.systems = sorted({p["system"] for p in points})
    else:
        with (a.out / "points.jsonl").open("a") as sink:
            for system in a.systems:  # one after the other: never two servers measuring at once
                with ExitStack() as stack:
                    url = start_system(system, a, stack)
                    points += measure_system(url, system, a.requests_, a, objective, sink)
                    if a.aiperf:
                        checks.append(measure_aiperf(url, system, a, objective))
    shape = f"{a.conversations}x{a.turns} turns" if a.workload == "chat" else a.mix
    title = f"{a.workload} ({shape}); {objective}"
    report = {
        "workload": a.workload, "mix": a.mix, "objective": asdict(objective), "attainment": a.attainment,
        "rates": a.rates, "cpu": cpu_name(), "points": points,
        "goodput": {s: goodput([p for p in points if p["system"] == s], a.attainment) for s in a.systems},
        "aiperf": checks,
    }
    (a.out / "goodput.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(points, a.attainment, title, a.out / "goodput.png", checks)
    print(table(points, a.attainment, checks))
    log(f"wrote {a.out}/goodput.json, goodput.png" + ("" if a.rescore else ", points.jsonl"))
    return 0


def rescore(runs: Sequence[str], objective: Objective) -> list[dict[str, Any]]:
    """Every point of earlier runs (`DIR` or `LABEL=DIR`: DIR/points.jsonl, each request's TTFT and
    TPOT) scored against `objective`, under LABEL or the run's own system name; a point keeps its rate,
    wall time and load average. Attainment at the measured rates only (bisection needs the servers)."""
    points = []
    for run in runs:
        label, _, path = run.rpartition("=")
        for line in (Path(path) / "points.jsonl").read_text().splitlines():
            row = json.loads(line)
            results = [load_gen.Result(**r) for r in row["results"]]
            new = point_row(label or row["system"], row["rate"], results, row["wall_s"], objective)
            points.append({**new, "loadavg_1m": row["loadavg_1m"], "run": path})
    return points


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
