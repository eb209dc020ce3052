"""Soak: N concurrent OpenAI clients for M minutes, every greedy text checked, stub resources sampled.

    .venv/bin/python bench/soak.py [--clients 32] [--minutes 10] [--dtype fp32] [--transport shm]
                                   [--max-tokens 16] [--disconnect-share 0.1] [--json PATH]
    .venv/bin/python bench/soak.py --url http://127.0.0.1:9000 [--server-pid PID] [--shm-root DIR]

Without `--url` it starts `rngd-pd serve` (tritonserver with the whole repository plus the OpenAI
front end) as a child on free 127.0.0.1 ports, with `--dtype fp32` by default (batching must not change
a greedy answer) and the KV transport of `--transport`: shm in a fresh directory under /dev/shm
(PD_SHM_ROOT), or tcp / nixl-ucx with a KV relay started for the run (AIRM_KV_TCP_ADDR). Everything
it starts is stopped by process group at the end, also on failure or Ctrl-C.

1. References: every prompt (a few dozen, deterministic, varied length; even ones through
   /v1/completions, odd ones through /v1/chat/completions) is served alone, one request at a time,
   greedy (temperature 0), not streamed.
2. Load: `clients` threads, each with its own `openai` SDK client (no retries, bounded timeouts), send
   requests back to back for `minutes`: a random prompt, streamed or not. A `disconnect-share` of the
   clients stream every request and close the HTTP connection after 1-3 chunks (a real disconnect,
   counted as expected; the text received so far must be a prefix of the reference). Every complete
   text must equal its reference exactly; anything else is a mismatch.
3. Samples, before the load (cold, and idle after the references), every `sample-s` during it, and
   after it (once the server settled): per Triton Python stub (processes named
   triton_python_backend_stub that descend from the tritonserver) RSS, threads and open files, and the
   transport's live blobs (shm: files under PD_SHM_ROOT/keys; tcp/nixl-ucx: the relay's blob count).
   RSS is also split into anonymous memory (the heap, where a leak shows) and mapped shared memory
   (the shm transport's pooled slot files, which follow the load and are trimmed when idle).

Exit status 1 on any error, mismatch, crash sign in the server log, or growth from the idle sample taken
right before the load to the sample after it: threads, open files and blobs must come back to that
baseline (`--thread-slack`, `--fd-slack`, default 0); RSS may grow by at most `--rss-pct` (10 %) plus
`--rss-mb` (64 MB) per stub (allocator arenas keep some memory after a burst). The baseline is the warm
idle sample, not the cold one: the first requests legitimately allocate (graph caches, pools filled
once); the cold sample is printed too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STUB_NAME = "triton_python_backend_stub"
TRANSPORTS = ("shm", "tcp", "nixl-ucx")
RELAY_TRANSPORTS = ("tcp", "nixl-ucx")
TOPICS = (
    "the history of the printing press", "how bees make honey", "the rules of chess",
    "baking sourdough bread", "why the sky is blue", "the water cycle", "how a compiler works",
    "the French revolution", "plate tectonics", "the life of a star", "how vaccines work",
    "the invention of the telephone", "photosynthesis in plants", "the Roman aqueducts",
    "how airplanes fly", "the game of go", "ocean tides", "the first computers",
)
LENGTHS = (0, 1, 2, 4, 8, 16)  # context sentences before the question: ~10 to ~250 prompt tokens


# ---- prompts -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Prompt:
    kind: str  # "completion" or "chat"
    text: str


def make_prompts(n: int) -> list[Prompt]:
    """n distinct deterministic prompts of varied length; even ones are completions, odd ones chats."""
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        reps = LENGTHS[(i * 7 + i // len(TOPICS)) % len(LENGTHS)]
        context = " ".join(f"Fact {j + 1} about {topic} is worth a sentence of its own." for j in range(reps))
        if i % 2:
            text = f"{context} Explain {topic} to a child in two sentences. (#{i})".strip()
            out.append(Prompt("chat", text))
        else:
            text = f"{context} Here is a short essay about {topic} (#{i}):".strip()
            out.append(Prompt("completion", text))
    return out


# ---- processes and samples ----------------------------------------------------------------------------

def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def process_table() -> dict[int, int]:
    """{pid: parent pid} of every process visible in /proc."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = _read(f"/proc/{name}/stat")
            table[int(name)] = int(stat[stat.rindex(")") + 2:].split()[1])
    return table


def descendants(root: int, table: dict[int, int] | None = None) -> list[int]:
    """Every process below `root` (children, grandchildren, ...), in ascending pid order."""
    table = process_table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, ppid in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found and child != root:
                found.append(child)
                todo.append(child)
    return sorted(found)


def cmdline(pid: int) -> list[str]:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    return []


def is_named(pid: int, name: str) -> bool:
    """Whether the process runs a program called `name` (argv[0]'s basename, else its 15-char comm)."""
    args = cmdline(pid)
    if args:
        return os.path.basename(args[0]) == name
    with contextlib.suppress(OSError):
        return _read(f"/proc/{pid}/comm").strip() == name[:15]
    return False


def find_named(root: int, name: str) -> list[int]:
    return [pid for pid in descendants(root) if is_named(pid, name)]


def stub_label(args: list[str]) -> str:
    """The model instance a stub serves (e.g. decode_0_0), else its model, from its command line."""
    model = next((Path(a).parent.parent.name for a in args if a.endswith("model.py")), "")
    if model:
        instance = next((a for a in args[1:] if a.startswith(f"{model}_")), "")
        return instance or model
    return os.path.basename(args[0]) if args else "?"


def proc_stats(pid: int) -> dict[str, Any] | None:
    """RSS (MB), threads and open files of one process; None when it is gone. RSS is also split into
    anonymous memory (the heap: where a leak shows) and mapped shared memory (the shm transport's
    pooled slot files, trimmed when idle)."""
    try:
        status = _read(f"/proc/{pid}/status")
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    mb = lambda name: round(int(fields.get(name, "0 kB").split()[0]) / 1024, 1)  # noqa: E731
    return {"pid": pid, "rss_mb": mb("VmRSS"), "anon_mb": mb("RssAnon"), "shm_mb": mb("RssShmem"),
            "threads": int(fields["Threads"]), "fds": fds}


def sample_stubs(root: int | None, name: str = STUB_NAME) -> dict[str, dict[str, Any]]:
    """{label: stats} of every process called `name` below `root` (labels made unique by pid)."""
    out: dict[str, dict[str, Any]] = {}
    if root is None:
        return out
    for pid in find_named(root, name):
        stats = proc_stats(pid)
        if stats is None:
            continue
        label = stub_label(cmdline(pid))
        out[label if label not in out else f"{label}#{pid}"] = stats
    return out


def count_shm_blobs(root: str) -> int:
    """Published blobs under a shm transport root: files in keys/<key>/."""
    keys = Path(root) / "keys"
    total = 0
    with contextlib.suppress(OSError):
        for key in keys.iterdir():
            with contextlib.suppress(OSError):
                total += sum(1 for _ in key.iterdir())
    return total


def blob_counter(transport: str, shm_root: str | None, relay: str | None) -> Callable[[], int | None]:
    """A function giving the transport's live blobs now (None when it cannot be known)."""
    if transport == "shm" and shm_root:
        return lambda: count_shm_blobs(shm_root)
    if transport in RELAY_TRANSPORTS and relay:
        def relay_blobs() -> int | None:
            from rngd_pd.kv.relay.tcp import RelayClient

            client = None
            try:
                client = RelayClient(relay)
                return int(client.stat()["blobs"])
            except Exception:  # a sample that cannot be read is shown as unknown
                return None
            finally:
                if client is not None:
                    with contextlib.suppress(Exception):
                        client.close()
        return relay_blobs
    return lambda: None


# ---- load ---------------------------------------------------------------------------------------------

@dataclass
class Stats:
    """What the clients did; shared by the client threads (every update under `lock`)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    done: int = 0
    errors: int = 0
    mismatches: int = 0
    disconnects: int = 0
    streamed: int = 0
    output_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    error_examples: list[str] = field(default_factory=list)
    mismatch_examples: list[dict] = field(default_factory=list)  # distinct (prompt, text) pairs
    mismatched_prompts: set[int] = field(default_factory=set)

    def error(self, msg: str) -> None:
        with self.lock:
            self.errors += 1
            self.done += 1
            if len(self.error_examples) < 5:
                self.error_examples.append(msg[:300])

    def result(self, *, index: int, text: str, ref: str, complete: bool, tokens: int = 0,
               ttft: float | None = None, streamed: bool = False) -> None:
        ok = text == ref if complete else ref.startswith(text)
        with self.lock:
            self.done += 1
            self.streamed += streamed
            self.disconnects += not complete
            self.output_tokens += tokens
            if ttft is not None:
                self.ttft_s.append(ttft)
            if not ok:
                self.mismatches += 1
                self.mismatched_prompts.add(index)
                example = {"prompt": index, "complete": complete, "stream": streamed, "expected": ref[:200],
                           "got": text[:200]}
                seen = [(e["prompt"], e["got"]) for e in self.mismatch_examples]
                if len(self.mismatch_examples) < 5 and (index, example["got"]) not in seen:
                    self.mismatch_examples.append(example)

    def counts(self) -> dict[str, int]:
        with self.lock:
            return {"done": self.done, "errors": self.errors, "mismatches": self.mismatches,
                    "disconnects": self.disconnects}


def make_client(url: str, timeout: float):
    import openai

    return openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key="none", max_retries=0,
                         timeout=openai.Timeout(timeout, connect=10.0))  # the SDK's own type (3.x: httpx2)


def ask(client, model: str, prompt: Prompt, max_tokens: int, stream: bool,
        disconnect_after: int | None = None) -> tuple[str, bool, int, float | None]:
    """(text, complete, completion tokens, seconds to the first text) of one greedy request."""
    common = {"model": model, "max_tokens": max_tokens, "temperature": 0}
    chat = prompt.kind == "chat"
    if not stream:
        if chat:
            r = client.chat.completions.create(messages=[{"role": "user", "content": prompt.text}], **common)
            text = r.choices[0].message.content or ""
        else:
            r = client.completions.create(prompt=prompt.text, **common)
            text = r.choices[0].text
        return text, True, r.usage.completion_tokens if r.usage else 0, None
    t0 = time.perf_counter()
    if chat:
        s = client.chat.completions.create(messages=[{"role": "user", "content": prompt.text}], stream=True,
                                           stream_options={"include_usage": True}, **common)
    else:
        s = client.completions.create(prompt=prompt.text, stream=True, stream_options={"include_usage": True},
                                      **common)
    parts: list[str] = []
    ttft, tokens, chunks = None, 0, 0
    try:
        for chunk in s:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if not chunk.choices:
                continue
            piece = (chunk.choices[0].delta.content if chat else chunk.choices[0].text) or ""
            if piece:
                parts.append(piece)
                ttft = ttft if ttft is not None else time.perf_counter() - t0
            chunks += 1
            if disconnect_after is not None and chunks >= disconnect_after:
                return "".join(parts), False, 0, ttft  # the finally closes the connection mid-stream
    finally:
        s.close()
    return "".join(parts), True, tokens, ttft


def client_loop(i: int, url: str, model: str, prompts: list[Prompt], refs: list[str],
                args: argparse.Namespace, deadline: float, stats: Stats, disconnecting: bool) -> None:
    """One client: requests back to back until the deadline, each checked against its reference."""
    rng = random.Random(args.seed * 100_003 + i)
    client = make_client(url, args.timeout)
    try:
        while time.monotonic() < deadline:
            index = rng.randrange(len(prompts))
            stream = disconnecting or rng.random() < 0.5
            cut = rng.randint(1, 3) if disconnecting else None
            try:
                text, complete, tokens, ttft = ask(client, model, prompts[index], args.max_tokens, stream,
                                                   cut)
            except Exception as exc:  # every failure of a request is counted and shown
                stats.error(f"client {i} prompt {index} ({prompts[index].kind}, stream={stream}): "
                            f"{type(exc).__name__}: {exc}")
                time.sleep(0.5)  # a failing server is not hammered in a tight loop
                continue
            stats.result(index=index, text=text, ref=refs[index], complete=complete, tokens=tokens, ttft=ttft,
                         streamed=stream)
    finally:
        client.close()


# ---- server -------------------------------------------------------------------------------------------

def serve_command(args: argparse.Namespace, openai_port: int) -> list[str]:
    """`rngd-pd serve` on 127.0.0.1 with any free Triton ports and the OpenAI front end on openai_port."""
    cmd = [sys.executable, "-m", "rngd_pd.cli", "serve", "--host", "127.0.0.1", "--http-port", "0",
           "--grpc-port", "0", "--metrics-port", "0", "--openai-port", str(openai_port),
           "--kv-transport", args.transport]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    return cmd + list(args.serve_arg)


def http_ok(url: str, timeout: float = 3.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, TimeoutError):
        return False


def served_model(url: str) -> str:
    with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=10) as resp:
        return json.loads(resp.read())["data"][0]["id"]


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


@dataclass
class Served:
    """A `rngd-pd serve` child: its url, its log, and the tritonserver below it."""

    proc: subprocess.Popen
    url: str
    log: Path
    groups: list[int] = field(default_factory=list)  # process groups of its children (own sessions)

    def triton_pid(self) -> int | None:
        found = find_named(self.proc.pid, "tritonserver")
        return found[0] if found else None

    def remember_groups(self) -> None:
        for pid in descendants(self.proc.pid):
            with contextlib.suppress(OSError):
                pgid = os.getpgid(pid)
                if pgid != self.proc.pid and pgid not in self.groups:
                    self.groups.append(pgid)

    def stop(self, grace_s: float = 40.0) -> None:
        """SIGTERM serve (it stops tritonserver and the front end), then SIGKILL whatever is left."""
        self.remember_groups()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                _kill_group(self.proc.pid)
                self.proc.wait(10)
        _kill_group(self.proc.pid)
        for pgid in self.groups:
            _kill_group(pgid)


@contextlib.contextmanager
def start_server(args: argparse.Namespace, env: dict[str, str], log: Path) -> Iterator[Served]:
    from rngd_pd.serve.server import free_port

    port = free_port("127.0.0.1")
    cmd = serve_command(args, port)
    print(f"  .. starting: {' '.join(cmd[1:])} (log {log})", file=sys.stderr, flush=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    served = Served(proc, f"http://127.0.0.1:{port}", log)
    try:
        t0 = time.monotonic()
        while not http_ok(served.url + "/health"):
            if proc.poll() is not None:
                raise RuntimeError(f"rngd-pd serve exited with code {proc.returncode} before it was ready\n"
                                   + log_tail(log))
            if time.monotonic() - t0 > args.ready_timeout:
                raise RuntimeError(f"rngd-pd serve not ready after {args.ready_timeout:.0f} s\n"
                                   + log_tail(log))
            served.remember_groups()
            time.sleep(1.0)
        served.remember_groups()
        print(f"  .. ready in {time.monotonic() - t0:.0f} s at {served.url}", file=sys.stderr, flush=True)
        yield served
    finally:
        served.stop()


def log_tail(log: Path, lines: int = 15) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    return ""


def find_tritonserver(uid: int | None = None) -> int | None:
    """The one tritonserver process of this user, when there is exactly one (for --url)."""
    uid = os.getuid() if uid is None else uid
    found = []
    for pid in process_table():
        with contextlib.suppress(OSError):
            if os.stat(f"/proc/{pid}").st_uid == uid and is_named(pid, "tritonserver"):
                found.append(pid)
    return found[0] if len(found) == 1 else None


# ---- summary ------------------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) by nearest rank; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def check_growth(base: dict, after: dict, rss_pct: float = 10.0, rss_mb: float = 64.0, thread_slack: int = 0,
                 fd_slack: int = 0) -> list[str]:
    """What grew from `base` to `after` (sample rows) beyond the tolerances; [] when nothing did."""
    problems = []
    for label, b in base["stubs"].items():
        a = after["stubs"].get(label)
        if a is None:
            problems.append(f"stub {label} (pid {b['pid']}) is gone")
            continue
        if a["pid"] != b["pid"]:
            problems.append(f"stub {label} was restarted (pid {b['pid']} -> {a['pid']})")
            continue
        limit = b["rss_mb"] * (1 + rss_pct / 100) + rss_mb
        if a["rss_mb"] > limit:
            problems.append(f"stub {label} RSS {b['rss_mb']:.0f} -> {a['rss_mb']:.0f} MB "
                            f"(limit {limit:.0f} MB: +{rss_pct:g} % + {rss_mb:g} MB)")
        if a["threads"] > b["threads"] + thread_slack:
            problems.append(f"stub {label} threads {b['threads']} -> {a['threads']}")
        if a["fds"] > b["fds"] + fd_slack:
            problems.append(f"stub {label} open files {b['fds']} -> {a['fds']}")
    for label in after["stubs"].keys() - base["stubs"].keys():
        problems.append(f"stub {label} (pid {after['stubs'][label]['pid']}) appeared during the run")
    if base.get("blobs") is not None and after.get("blobs") is not None and after["blobs"] > base["blobs"]:
        problems.append(f"live blobs {base['blobs']} -> {after['blobs']}")
    return problems


def growth_rows(base: dict, after: dict) -> dict[str, dict[str, Any]]:
    """Per stub: RSS / threads / fds before and after and the change."""
    out = {}
    for label, b in base["stubs"].items():
        a = after["stubs"].get(label)
        if a is not None:
            keys = [k for k in ("rss_mb", "anon_mb", "shm_mb", "threads", "fds") if k in a and k in b]
            out[label] = {k: [b[k], a[k], round(a[k] - b[k], 1)] for k in keys}
    return out


def summarize(stats: Stats, load_s: float, base: dict, after: dict, problems: list[str], signs: list[str],
              expect_stubs: bool) -> dict[str, Any]:
    counts = stats.counts()
    p50, p99 = percentile(stats.ttft_s, 0.5), percentile(stats.ttft_s, 0.99)
    reasons = list(problems)
    if counts["errors"]:
        reasons.append(f"{counts['errors']} errors")
    if counts["mismatches"]:
        reasons.append(f"{counts['mismatches']} mismatches")
    if signs:
        reasons.append(f"crash signs in the server log: {', '.join(signs)}")
    if not counts["done"]:
        reasons.append("no request was served")
    if expect_stubs and not base["stubs"]:
        reasons.append(f"no {STUB_NAME} process found below the tritonserver")
    return {"summary": True, "requests": counts["done"], "errors": counts["errors"],
            "mismatches": counts["mismatches"], "mismatched_prompts": sorted(stats.mismatched_prompts),
            "disconnects": counts["disconnects"],
            "streamed": stats.streamed,
            "ttft_p50_ms": None if p50 is None else round(p50 * 1e3, 1),
            "ttft_p99_ms": None if p99 is None else round(p99 * 1e3, 1),
            "output_tokens": stats.output_tokens, "load_s": round(load_s, 1),
            "output_tok_s": round(stats.output_tokens / load_s, 2) if load_s > 0 else 0.0,
            "blobs": [base.get("blobs"), after.get("blobs")], "growth": growth_rows(base, after),
            "error_examples": stats.error_examples, "mismatch_examples": stats.mismatch_examples,
            "problems": reasons, "ok": not reasons}


# ---- table --------------------------------------------------------------------------------------------

def _stub_cell(s: dict | None) -> str:
    return "gone" if s is None else f"{s['rss_mb']:.0f}/{s['threads']}/{s['fds']}"


def format_header(labels: list[str]) -> str:
    cols = " ".join(f"{label[:16]:>16}" for label in labels)
    return (f"{'t s':>6} {'phase':<6} {'done':>6} {'err':>4} {'mism':>4} {'disc':>4} {cols} {'blobs':>5}"
            f"\n{'':>6} {'':<6} {'':>6} {'':>4} {'':>4} {'':>4} "
            + " ".join(f"{'RSS MB/thr/fds':>16}" for _ in labels))


def format_row(row: dict, labels: list[str]) -> str:
    cells = " ".join(f"{_stub_cell(row['stubs'].get(label)):>16}" for label in labels)
    extra = [f"+{k}:{_stub_cell(v)}" for k, v in row["stubs"].items() if k not in labels]
    blobs = "-" if row.get("blobs") is None else str(row["blobs"])
    return (f"{row['t_s']:>6.0f} {row['phase']:<6} {row['done']:>6} {row['errors']:>4} "
            f"{row['mismatches']:>4} {row['disconnects']:>4} {cells} {blobs:>5}"
            + (" " + " ".join(extra) if extra else ""))


def format_summary(s: dict, args: argparse.Namespace) -> str:
    ms = lambda v: "-" if v is None else f"{v:.0f} ms"  # noqa: E731
    lines = [
        f"\n{s['requests']} requests ({s['streamed']} streamed, {s['disconnects']} disconnected on purpose) "
        f"in {s['load_s']:.0f} s from {args.clients} clients: {s['errors']} errors, "
        f"{s['mismatches']} mismatches"
        + (f" (prompts {', '.join(map(str, s['mismatched_prompts']))})" if s["mismatched_prompts"] else ""),
        f"TTFT p50 {ms(s['ttft_p50_ms'])}, p99 {ms(s['ttft_p99_ms'])} (streams); "
        f"{s['output_tok_s']:.1f} output tokens/s ({s['output_tokens']} tokens)",
        f"growth, idle before the load -> after it (RSS tolerance +{args.rss_pct:g} % + {args.rss_mb:g} MB; "
        f"threads/fds/blobs must return to the baseline):",
    ]
    for label, g in s["growth"].items():
        split = "".join(f", {name} {g[k][0]:.0f} -> {g[k][1]:.0f}" for k, name in
                        (("anon_mb", "anon"), ("shm_mb", "shm")) if k in g)
        lines.append(f"  {label:<16} RSS {g['rss_mb'][0]:.0f} -> {g['rss_mb'][1]:.0f} MB "
                     f"({g['rss_mb'][2]:+.0f}{split})"
                     f"  threads {g['threads'][0]} -> {g['threads'][1]} ({g['threads'][2]:+d})"
                     f"  fds {g['fds'][0]} -> {g['fds'][1]} ({g['fds'][2]:+d})")
    b0, b1 = s["blobs"]
    lines.append(f"  live blobs {'-' if b0 is None else b0} -> {'-' if b1 is None else b1}")
    for e in s["error_examples"]:
        lines.append(f"  error: {e}")
    for m in s["mismatch_examples"]:
        lines.append(f"  mismatch: {json.dumps(m)}")
    lines.append("OK" if s["ok"] else "FAILED: " + "; ".join(s["problems"]))
    return "\n".join(lines)


# ---- main ---------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=32, help="concurrent clients")
    p.add_argument("--minutes", type=float, default=10.0, help="how long the load runs")
    p.add_argument("--url", help="an OpenAI front end already running (else rngd-pd serve is started)")
    p.add_argument("--server-pid", type=int,
                   help="with --url: the tritonserver whose stubs to sample (default: this user's only one)")
    p.add_argument("--shm-root", help="with --url: the server's PD_SHM_ROOT, to count live shm blobs")
    p.add_argument("--relay", help="with --url: the relay host:port (tcp, nixl-ucx), to count live blobs")
    p.add_argument("--transport", choices=TRANSPORTS, default="shm",
                   help="KV transport of the started server")
    p.add_argument("--dtype", default="fp32", help="compute dtype of the started server ('' = its default)")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="extra rngd-pd serve argument (repeatable)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--prompts", type=int, default=32, help="distinct prompts (a few dozen)")
    p.add_argument("--disconnect-share", type=float, default=0.1,
                   help="share of clients that close every stream after 1-3 chunks")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a request may wait for a response")
    p.add_argument("--sample-s", type=float, default=10.0, help="seconds between samples during the load")
    p.add_argument("--settle-s", type=float, default=90.0,
                   help="after the load, wait up to this long for the resources to return to the baseline")
    p.add_argument("--rss-pct", type=float, default=10.0, help="RSS growth tolerance per stub, percent")
    p.add_argument("--rss-mb", type=float, default=64.0, help="RSS growth tolerance per stub, MB on top")
    p.add_argument("--thread-slack", type=int, default=0, help="threads a stub may keep above the baseline")
    p.add_argument("--fd-slack", type=int, default=0, help="open files a stub may keep above the baseline")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=600.0,
                   help="seconds to wait for the started server")
    p.add_argument("--json", type=Path, help="write every sample row and the summary here (JSON lines)")
    p.add_argument("--log", type=Path, help="keep the server log here")
    args = p.parse_args(argv)
    if args.clients < 1:
        p.error("--clients must be at least 1")
    if args.minutes <= 0 or args.timeout <= 0 or args.sample_s <= 0 or args.settle_s < 0:
        p.error("--minutes, --timeout and --sample-s must be positive, --settle-s not negative")
    if not 0 <= args.disconnect_share <= 1:
        p.error("--disconnect-share is a share between 0 and 1")
    if args.prompts < 1 or args.max_tokens < 1:
        p.error("--prompts and --max-tokens must be at least 1")
    if not args.url and (args.server_pid or args.shm_root or args.relay):
        p.error("--server-pid, --shm-root and --relay go with --url (a started server is found by itself)")
    return args


def disconnecting_clients(clients: int, share: float) -> int:
    """How many clients disconnect mid-stream: the share, rounded, at least one when the share is > 0."""
    return 0 if share <= 0 else min(clients, max(1, round(clients * share)))


class Sampler:
    """Takes sample rows (stub stats + blobs + client counts), prints each as a table line."""

    def __init__(self, root: Callable[[], int | None], blobs: Callable[[], int | None], stats: Stats,
                 out: Callable[[dict], None]) -> None:
        self.root, self.blobs, self.stats, self.out = root, blobs, stats, out
        self.t0 = time.monotonic()
        self.rows: list[dict] = []
        self.labels: list[str] | None = None

    def take(self, phase: str, show: bool = True) -> dict:
        row = {"t_s": round(time.monotonic() - self.t0, 1), "phase": phase, **self.stats.counts(),
               "stubs": sample_stubs(self.root()), "blobs": self.blobs()}
        if show:
            if self.labels is None:
                self.labels = sorted(row["stubs"])
                print(format_header(self.labels), flush=True)
            print(format_row(row, self.labels), flush=True)
            self.rows.append(row)
            self.out(row)
        return row


def settled(base: dict, row: dict, args: argparse.Namespace) -> bool:
    return not check_growth(base, row, args.rss_pct, args.rss_mb, args.thread_slack, args.fd_slack)


def run_soak(args: argparse.Namespace, url: str, triton: Callable[[], int | None],
             blobs: Callable[[], int | None],
             emit: Callable[[dict], None]) -> tuple[Stats, float, dict, dict]:
    """References, then the load with samples, then the settle; (stats, load seconds, baseline, after)."""
    stats = Stats()
    sampler = Sampler(triton, blobs, stats, emit)
    model = served_model(url)
    prompts = make_prompts(args.prompts)
    sampler.take("cold")
    client = make_client(url, args.timeout)
    refs = []
    t0 = time.monotonic()
    try:
        for i, prompt in enumerate(prompts):
            try:
                refs.append(ask(client, model, prompt, args.max_tokens, stream=False)[0])
            except Exception as exc:  # no reference, no soak: say which one and why
                raise RuntimeError(f"the reference request for prompt {i} ({prompt.kind}) failed: "
                                   f"{type(exc).__name__}: {exc}") from exc
            if (i + 1) % 8 == 0 or i + 1 == len(prompts):
                print(f"  .. references {i + 1}/{len(prompts)} ({time.monotonic() - t0:.0f} s)",
                      file=sys.stderr, flush=True)
    finally:
        client.close()
    base = sampler.take("idle")
    n_cut = disconnecting_clients(args.clients, args.disconnect_share)
    start = time.monotonic()
    deadline = start + args.minutes * 60
    threads = [threading.Thread(target=client_loop, name=f"soak-client-{i}", daemon=True,
                                args=(i, url, model, prompts, refs, args, deadline, stats, i < n_cut))
               for i in range(args.clients)]
    for t in threads:
        t.start()
    join_by = deadline + 2 * args.timeout + 30
    next_sample = start + args.sample_s
    while any(t.is_alive() for t in threads) and time.monotonic() < join_by:
        time.sleep(max(0.0, min(1.0, next_sample - time.monotonic())))
        if time.monotonic() >= next_sample:
            sampler.take("load")
            next_sample += args.sample_s
    load_s = time.monotonic() - start
    stuck = sum(t.is_alive() for t in threads)
    for _ in range(stuck):
        stats.error("a client thread did not finish its last request in time")
    settle_until = time.monotonic() + args.settle_s
    after = sampler.take("settle", show=False)
    while not settled(base, after, args) and time.monotonic() < settle_until:
        time.sleep(2.0)
        after = sampler.take("settle", show=False)
    after = sampler.take("after")
    return stats, load_s, base, after


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bench.pd_stress import crash_signs

    json_out = open(args.json, "w") if args.json else None  # noqa: SIM115 - closed below

    def emit(row: dict) -> None:
        if json_out is not None:
            json_out.write(json.dumps(row) + "\n")
            json_out.flush()
    code = 1
    try:
        with contextlib.ExitStack() as stack:
            if args.url:
                url = args.url.rstrip("/")
                pid = args.server_pid or find_tritonserver()
                if pid is None:
                    print("  .. no single tritonserver of this user found; stubs are not sampled "
                          "(pass --server-pid)", file=sys.stderr)
                relay = args.relay
                transport = "shm" if args.shm_root else ("tcp" if relay else "")
                blobs = blob_counter(transport, args.shm_root, relay)
                triton, log = (lambda: pid), None
            else:
                tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rngd-pd-soak-")))
                log = args.log or tmp / "serve.log"
                env = {}
                shm_root = relay = None
                if args.transport == "shm":
                    shm_root = tempfile.mkdtemp(prefix="rngd-pd-soak-shm-",
                                                dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
                    stack.callback(shutil.rmtree, shm_root, True)
                    env["PD_SHM_ROOT"] = shm_root
                else:
                    from bench.pd_stress import TRANSPORT_DEFAULTS
                    from rngd_pd.kv.relay.proc import start_relay

                    relay = stack.enter_context(start_relay()).addr
                    env["AIRM_KV_TCP_ADDR"] = relay
                    env.update({k: os.environ.get(k, v) for k, v in TRANSPORT_DEFAULTS.items()})
                served = stack.enter_context(start_server(args, env, log))
                url, pid = served.url, None
                blobs = blob_counter(args.transport, shm_root, relay)

                def triton() -> int | None:
                    return served.triton_pid()
            stats, load_s, base, after = run_soak(args, url, triton, blobs, emit)
            problems = check_growth(base, after, args.rss_pct, args.rss_mb, args.thread_slack, args.fd_slack)
            text = log.read_text(errors="replace") if log is not None and log.exists() else ""
            summary = summarize(stats, load_s, base, after, problems, crash_signs(text),
                                expect_stubs=not args.url or pid is not None)
            emit(summary)
            print(format_summary(summary, args), flush=True)
            code = 0 if summary["ok"] else 1
    except (RuntimeError, OSError) as exc:
        print(f"soak: {exc}", file=sys.stderr)
    except KeyboardInterrupt:
        print("soak: interrupted", file=sys.stderr)
        code = 130
    finally:
        if json_out:
            json_out.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
