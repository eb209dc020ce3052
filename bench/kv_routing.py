"""Prefix-aware routing by KV events, measured: two prefill instances behind a router that sees only
their published events (rngd_pd.testing.kv_router), against round-robin and one instance alone; and
one prefill with publishing on against off.

    python bench/kv_routing.py routing [--conversations 8 --turns 10 --rounds 3 --load 0.7] [--json F]
    python bench/kv_routing.py overhead [--requests 24 --prompt-tokens 512] [--json F]

Servers: tritonservers holding only `prefill` (cpu config, compute dtype auto unless --dtype, shm
transport whose unread KV expires after 15 s, `share_cores` off: one core each, like pods on their own
nodes), each with KV events on (`--kv-events-config`: PUB
bound on an ipc endpoint, replay on 127.0.0.1) except the `off` server of `overhead`. Requests go to
the `prefill` model by tritonclient gRPC; TTFT is that call's latency (prefill computes the first
token), client side. Hit rate is prefill's own counter (`rngd_pd_prefix_cache_hits_total` over
`..._queries_total`, prompt tokens) summed over the servers a policy used.

* routing: a multi-turn chat trace (`--conversations` chats of `--turns` turns sharing one system
  prompt; each turn's prompt is the whole history through the model's chat template, so a returning
  chat repeats its earlier prompt as a prefix); the conversations' turns arrive in a seeded random
  order. Every round salts the system prompt (no round reuses another's blocks) and first puts it on
  every pod (a one-turn chat of its own, not measured: a deployment's shared system prompt is on each
  pod once traffic has reached it). Each round runs `single` (1 instance, one request at a time: the
  hit-rate reference), then `events` (2 instances, routed by their events) and `round-robin`
  (2 instances), their order alternating between rounds. The two-pod policies get the same open-loop
  traffic: Poisson arrivals at `--load` x two pods' capacity (capacity = 1 / single's mean TTFT in
  round 0; `--rate` sets the rate instead), a chat's turn held until its previous turn is answered;
  with requests in flight the event router adds llm-d's queue term (requests in flight per pod).
  `--load 0 --rate 0` sends every policy one request at a time (`--concurrency N`: N clients).
  Judged (issue 30): events' hit rate >= 0.9 x single's, events' TTFT p50 <= round-robin's / 1.5.
* overhead: unique prompts of `--prompt-tokens` random ids, each sent to the `on` and the `off` server
  (alternating which goes first). Judged: TTFT p50 on / off - 1 under 2 %. Also reported: the CPU time
  publishing adds per prompt, measured in this process, as a share of the off server's TTFT p50 (the
  TTFTs of a loaded host move by more than 2 % between calls).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BLOCK = 16
WORDS = ("harbour", "vessel", "cargo", "manifest", "port", "pilot", "tide", "berth", "crane", "invoice",
         "customs", "route", "weather", "delay", "schedule", "captain", "crew", "anchor", "container",
         "freight", "dock", "quay", "ledger", "signal", "voyage")


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def p50(values: Sequence[float]) -> float:
    return float(np.percentile(values, 50)) if values else float("nan")


# ---- servers -----------------------------------------------------------------------------------


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def prefill_servers(names: Sequence[str], events_on: Sequence[str], dtype: str) -> Iterator[dict[str, Any]]:
    """{name: (ready TritonServer, its KV events config or None)}, prefill only; stopped on exit."""
    from rngd_pd.serve.server import ServerConfig, TritonServer

    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rngd-pd-kv-routing-")))
        repo = tmp / "repo"
        repo.mkdir()
        (repo / "prefill").symlink_to(ROOT / "model_repository" / "prefill", target_is_directory=True)
        started: dict[str, Any] = {}
        for name in names:
            shm = stack.enter_context(tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm")
                                                                  else None))
            # share_cores off: each server is a pod with its own core, as pods on separate nodes are
            # (lending would let a lone pod use both, so "two pods' capacity" would be overstated)
            env = {"AIRM_KV_TRANSPORT": "shm", "PD_SHM_ROOT": shm, "AIRM_KV_SHM_TTL_S": "15",
                   "RNGD_PD_DTYPE": dtype, "RNGD_PD_PARAM_PREFIX_BLOCK": str(BLOCK),
                   "RNGD_PD_PARAM_SHARE_CORES": "false"}
            cfg_events = None
            if name in events_on:
                cfg_events = {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp}/{name}.pub",
                              "replay_endpoint": f"tcp://127.0.0.1:{_port()}", "topic": f"kv@{name}@smollm2"}
                env["RNGD_PD_KV_EVENTS_CONFIG"] = json.dumps(cfg_events)
            cfg = ServerConfig(repo, "cpu", http_port=0, grpc_port=0, metrics_port=0, env=env)
            started[name] = (stack.enter_context(TritonServer(cfg, log=tmp / f"{name}.log")), cfg_events)
        try:
            for name, (server, _) in started.items():
                say(f"waiting for prefill server {name} ...")
                server.wait_ready(900)
            yield started
        except BaseException:
            for name, (server, _) in started.items():
                say(f"--- prefill server {name}: log tail ---\n{server.log_tail(40)}")
            raise


def prefill(url: str, key: str, ids: Sequence[int]) -> float:
    """Seconds one `prefill` call takes (its first token)."""
    import tritonclient.grpc as grpcclient

    from rngd_pd.testing.e2e import grpc_inputs
    from rngd_pd.wire import tensors as T

    values = {T.REQUEST_KEY: np.array([key.encode()], dtype=np.object_), T.INPUT_IDS: np.array(ids, np.int32)}
    client = grpcclient.InferenceServerClient(url)
    try:
        t0 = time.perf_counter()
        client.infer("prefill", grpc_inputs(values), timeout=600)
        return time.perf_counter() - t0
    finally:
        client.close()


def prefix_counters(server: Any) -> tuple[float, float]:
    """(queried, hit) prompt tokens of prefill's prefix cache since start."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for name in ("rngd_pd_prefix_cache_queries_total", "rngd_pd_prefix_cache_hits_total"):
        rows = [ln for ln in text.splitlines() if ln.startswith(name + "{") and 'model="prefill"' in ln]
        out[name] = sum(float(r.rsplit(" ", 1)[1]) for r in rows)
    return out["rngd_pd_prefix_cache_queries_total"], out["rngd_pd_prefix_cache_hits_total"]


# ---- the chat trace ----------------------------------------------------------------------------


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def chat_trace(tok: Any, conversations: int, turns: int, seed: int, salt: str) -> list[tuple[int, list[int]]]:
    """[(conversation, prompt ids)] in arrival order: each conversation's turns in order, the
    conversations interleaved at random; turn t's prompt is the system prompt and the whole history
    (the earlier turns' user messages and replies)."""
    rng = random.Random(seed)
    system = f"Session {salt}. You are the operations assistant of a shipping line. " + " ".join(
        sentence(rng, 12) for _ in range(8))
    histories: list[list[dict]] = [[{"role": "system", "content": system}] for _ in range(conversations)]
    order = [c for c in range(conversations) for _ in range(turns)]
    rng.shuffle(order)
    out = []
    for c in order:
        histories[c].append({"role": "user", "content": " ".join(sentence(rng, 10) for _ in range(3))})
        out.append((c, tok.encode(tok.apply_chat_template(histories[c]))))
        histories[c].append({"role": "assistant", "content": " ".join(sentence(rng, 12) for _ in range(6))})
    return out


def arrivals(count: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each of `count` requests arrives: a Poisson process of
    `rate` per second (seeded, so every policy of a round sees the same times)."""
    rng = np.random.default_rng(seed)
    return np.cumsum(rng.exponential(1 / rate, size=count)).tolist()


# ---- routing -----------------------------------------------------------------------------------


def run_routing(args: argparse.Namespace) -> dict:
    from rngd_pd.config import kv_events
    from rngd_pd.engine.kv_events.subscriber import Subscriber
    from rngd_pd.model.checkpoint import load_tokenizer
    from rngd_pd.testing.kv_router import EventRouter

    _, tok = load_tokenizer()
    rows: list[dict] = []
    with prefill_servers(("a", "b"), ("a", "b"), args.dtype) as servers:
        subs = {}
        for name, (_, cfg) in servers.items():
            c = kv_events.parse(cfg)
            subs[name] = Subscriber(c.endpoint, c.replay_endpoint, topic="kv@")
        router = EventRouter(subs, BLOCK)
        time.sleep(0.5)
        for name, sub in subs.items():  # what was published before we subscribed (the start's reset)
            for received in sub.replay(0):
                router.pods[name].apply(received.batch)
        warm = chat_trace(tok, 2, 2, seed=args.seed + 999, salt="warm-up")
        for name, (server, _) in servers.items():  # first calls pay one-time costs (allocations, kernels)
            for i, (_, ids) in enumerate(warm):
                prefill(server.grpc_url, f"warm-{name}-{i}", ids)
        rate = args.rate
        for rnd in range(args.rounds):
            # single first, one request at a time: the hit-rate reference and, in round 0, the
            # service time that sets the open-loop rate (--load); then the two-pod policies
            pair = ("events", "round-robin") if rnd % 2 == 0 else ("round-robin", "events")
            for policy in ("single", *pair):
                salt = f"r{rnd}-{policy}"
                trace = chat_trace(tok, args.conversations, args.turns, seed=args.seed + rnd, salt=salt)
                # the round's system prompt is on every pod first, as a deployment's shared system
                # prompt is once traffic has reached each pod (else the first pod to see it keeps
                # every new chat and the other idles): a one-turn chat of its own, not measured
                opener = chat_trace(tok, 1, 1, seed=args.seed + rnd, salt=salt)[0][1]
                for name, (server, _) in servers.items():
                    prefill(server.grpc_url, f"{salt}-system-{name}", opener)
                before = {n: prefix_counters(s) for n, (s, _) in servers.items()}
                policy_rate = 0.0 if policy == "single" else rate
                say(f"round {rnd} {policy}: {len(trace)} requests"
                    + (f", Poisson arrivals at {policy_rate:.2f}/s" if policy_rate else ", one at a time"))
                got = run_policy(policy, trace, servers, router, salt, args.concurrency, policy_rate,
                                 seed=args.seed + rnd)
                rows += [{"round": rnd, **row} for row in got]
                if policy == "single" and rnd == 0 and not rate and args.load:
                    service = float(np.mean([r["ttft_s"] for r in got]))
                    rate = args.load * 2 / service
                    say(f"one pod serves this trace in {1000 * service:.0f} ms a request: "
                        f"{args.load:.2f} of two pods' capacity is {rate:.2f} requests/s")
                router.refresh(50)
                after = {n: prefix_counters(s) for n, (s, _) in servers.items()}
                q = sum(after[n][0] - before[n][0] for n in servers)
                h = sum(after[n][1] - before[n][1] for n in servers)
                rows.append({"round": rnd, "policy": policy, "summary": True, "queried": q, "hits": h})
        args.rate_used = rate
        for sub in subs.values():
            sub.close()
    return summarize_routing(rows, args)


def run_policy(policy: str, trace: list[tuple[int, list[int]]], servers: dict[str, Any], router: Any,
               salt: str, concurrency: int, rate: float = 0.0, seed: int = 0) -> list[dict]:
    """Send the trace under one policy; a chat's turn is sent only once its previous turn has been
    answered (a user waits for the reply).

    rate 0: conversation c is served by client c % concurrency, its turns one after another.
    rate > 0 (open loop): turns arrive as a Poisson process of `rate` per second in trace order, each
    on its own thread; one whose previous turn is still running is held until it is answered (TTFT
    counts from when it is sent, the hold is recorded). With requests in flight at once the event
    router also weighs them per pod (rngd_pd.testing.kv_router), as llm-d's queue scorer does."""
    lock, rr = threading.Lock(), itertools.count()
    inflight = {name: 0 for name in servers}
    weigh_queue = concurrency > 1 or rate > 0
    rows: list[dict] = []
    start = time.perf_counter()

    def pick(ids: list[int]) -> tuple[str, int]:
        with lock:
            if policy == "events":
                pod, expected = router.route(ids, dict(inflight) if weigh_queue else None)
            elif policy == "round-robin":
                pod, expected = ("a", "b")[next(rr) % 2], -1
            else:
                pod, expected = "a", -1
            inflight[pod] += 1
        return pod, expected

    def send(i: int, conv: int, ids: list[int], arrived: float) -> None:
        sent = time.perf_counter() - start
        pod, expected = pick(ids)
        try:
            ttft = prefill(servers[pod][0].grpc_url, f"{salt}-{i}", ids)
        finally:
            with lock:
                inflight[pod] -= 1
        with lock:
            rows.append({"policy": policy, "index": i, "conversation": conv, "pod": pod,
                         "prompt_tokens": len(ids), "router_expected_tokens": expected, "ttft_s": ttft,
                         "held_s": max(0.0, sent - arrived)})

    if rate <= 0:
        def client(items: list[tuple[int, int, list[int]]]) -> None:
            for i, conv, ids in items:
                send(i, conv, ids, time.perf_counter() - start)

        work = [[(i, c, ids) for i, (c, ids) in enumerate(trace) if c % concurrency == k]
                for k in range(concurrency)]
        run_threads([threading.Thread(target=client, args=(items,)) for items in work])
        return sorted(rows, key=lambda r: r["index"])

    latest: dict[int, threading.Event] = {}

    def turn(i: int, conv: int, ids: list[int], arrived: float, previous: threading.Event | None,
             answered: threading.Event) -> None:
        try:
            if previous is not None and not previous.wait(900):
                raise TimeoutError(f"turn {i}: the previous turn of chat {conv} took over 900 s")
            send(i, conv, ids, arrived)
        finally:
            answered.set()

    threads = []
    for i, ((conv, ids), at) in enumerate(zip(trace, arrivals(len(trace), rate, seed), strict=True)):
        time.sleep(max(0.0, start + at - time.perf_counter()))
        answered = threading.Event()
        threads.append(threading.Thread(target=turn, args=(i, conv, ids, at, latest.get(conv), answered)))
        latest[conv] = answered
        threads[-1].start()
    run_threads(threads, started=True)
    if len(rows) != len(trace):
        raise RuntimeError(f"{policy}: {len(trace) - len(rows)} of {len(trace)} requests failed (see above)")
    return sorted(rows, key=lambda r: r["index"])


def run_threads(threads: list[threading.Thread], started: bool = False, timeout_s: float = 3600) -> None:
    """Start (unless started) and join every thread, within `timeout_s` in all."""
    if not started:
        for t in threads:
            t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"requests still running after {timeout_s:.0f} s")


def summarize_routing(rows: list[dict], args: argparse.Namespace) -> dict:
    out: dict[str, Any] = {"policies": {}}
    for policy in ("events", "round-robin", "single"):
        reqs = [r for r in rows if r["policy"] == policy and not r.get("summary")]
        sums = [r for r in rows if r["policy"] == policy and r.get("summary")]
        q, h = sum(r["queried"] for r in sums), sum(r["hits"] for r in sums)
        ttft = [r["ttft_s"] for r in reqs]
        out["policies"][policy] = {"requests": len(reqs), "hit_rate": h / q if q else 0.0,
                                   "ttft_p50_ms": 1000 * p50(ttft),
                                   "ttft_mean_ms": 1000 * float(np.mean(ttft)),
                                   "held_mean_ms": 1000 * float(np.mean([r.get("held_s", 0) for r in reqs])),
                                   "pods": {n: sum(r["pod"] == n for r in reqs) for n in ("a", "b")},
                                   "ttft_p90_ms": 1000 * float(np.percentile(ttft, 90))}
    pol = out["policies"]
    out["open_loop_rate_per_s"] = getattr(args, "rate_used", 0.0)
    out["hit_rate_vs_single"] = pol["events"]["hit_rate"] / pol["single"]["hit_rate"]
    out["ttft_p50_rr_over_events"] = pol["round-robin"]["ttft_p50_ms"] / pol["events"]["ttft_p50_ms"]
    out["judged"] = {"hit_rate_ge_0.9_single": out["hit_rate_vs_single"] >= 0.9,
                     "ttft_p50_1.5x_lower_than_rr": out["ttft_p50_rr_over_events"] >= 1.5}
    out["rows"] = rows
    out["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    return out


# ---- publishing overhead -----------------------------------------------------------------------


def run_overhead(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(args.seed)
    rows = []
    with prefill_servers(("on", "off"), ("on",), args.dtype) as servers:
        for i in range(args.requests + 1):
            ids = rng.integers(100, 40_000, size=args.prompt_tokens).tolist()
            order = ("on", "off") if i % 2 == 0 else ("off", "on")
            for name in order:
                ttft = prefill(servers[name][0].grpc_url, f"{name}-{i}", ids)
                if i:  # the first request of each server warms it and is left out
                    rows.append({"server": name, "index": i, "ttft_s": ttft})
    on = [r["ttft_s"] for r in rows if r["server"] == "on"]
    off = [r["ttft_s"] for r in rows if r["server"] == "off"]
    ratio = p50(on) / p50(off)
    work = events_cpu_ms(args.prompt_tokens, args.seed)
    return {"ttft_p50_on_ms": 1000 * p50(on), "ttft_p50_off_ms": 1000 * p50(off), "on_over_off": ratio,
            "events_cpu_ms_per_request": work, "events_cpu_share_of_ttft_off": work / (1000 * p50(off)),
            "judged": {"under_2_percent": abs(ratio - 1) < 0.02}, "rows": rows,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}


def events_cpu_ms(prompt_tokens: int, seed: int, repeat: int = 50) -> float:
    """CPU milliseconds that publishing adds to one prompt of `prompt_tokens` new tokens, measured in
    this process (load-independent, unlike the TTFTs): building its BlockStored event, queueing it
    and encoding it (the sender thread's share; hashing is not counted, the cache names its blocks
    with the same hashes whether or not it publishes)."""
    from rngd_pd.engine.kv_events import hashing, messages

    ids = np.random.default_rng(seed).integers(100, 40_000, size=prompt_tokens).tolist()
    names = hashing.block_hashes(ids, BLOCK, hashing.none_hash())
    t0 = time.process_time()
    for _ in range(repeat):
        event = messages.stored([hashing.external(h) for h in names], None, ids[:len(names) * BLOCK], BLOCK)
        messages.ENCODER.encode(messages.batch([event]))
    return 1000 * (time.process_time() - t0) / repeat


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("routing")
    r.add_argument("--conversations", type=int, default=8)
    r.add_argument("--turns", type=int, default=10)
    r.add_argument("--rounds", type=int, default=3,
                   help="rounds: single, then events and round-robin (their order alternating)")
    r.add_argument("--load", type=float, default=0.7,
                   help="open-loop offered load of the two-pod policies, as a share of two pods' capacity "
                        "(from single's mean TTFT in round 0); 0 with --rate 0: one request at a time")
    r.add_argument("--rate", type=float, default=0.0, help="open-loop arrivals per second (overrides --load)")
    r.add_argument("--concurrency", type=int, default=1,
                   help="clients sending at once (conversation c on client c %% N); above 1 the event "
                        "router also weighs requests in flight, as llm-d's queue scorer")
    o = sub.add_parser("overhead")
    o.add_argument("--requests", type=int, default=24)
    o.add_argument("--prompt-tokens", type=int, default=512)
    for p in (r, o):
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--dtype", default="auto", help="compute dtype of the servers (RNGD_PD_DTYPE)")
        p.add_argument("--json", type=Path, help="write the result (rows included) here")
    args = ap.parse_args(argv)
    result = run_routing(args) if args.mode == "routing" else run_overhead(args)
    result["uptime"] = Path("/proc/loadavg").read_text().split()[:3]
    table = {k: v for k, v in result.items() if k not in ("rows", "args")}
    print(json.dumps(table, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
