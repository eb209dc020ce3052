"""Where the served path spends its time: py-spy samples of every Python stub under N concurrent streams.

    .venv/bin/python bench/profile_stubs.py [--streams 8,16] [--seconds 20] [--prompt-len 256]
                                            [--max-tokens 64] [--json FILE] [--keep DIR]

One tritonserver (prefill, decode, pd; cpu config; shm) serves closed-loop streams of unique prompts
(greedy, EOS ignored) to `pd` while `py-spy record --format raw` samples each stub (100 Hz,
non-blocking, idle threads left out) for `--seconds`. Each sample's stack is put in the first category
whose frames it contains, innermost first:

* model compute: `rngd_pd/model/` (prefill, decode_step, the KV cache copies)
* kv transport: `rngd_pd/kv/` (push, pull, checksums, the hand-off)
* responses: the sender thread, response building (`stubs/sending.py`, `pbutils.py`, the pb_utils C module)
* engine host work: the decode scheduler, sampling, detokenizing (`rngd_pd/engine/`, `model/sampling`)
* orchestration: pd's BLS calls, request parsing (`engine/orchestrator.py`, `stubs/clients.py`,
  `wire/inputs.py`)
* other

and a sample whose innermost frame only waits (a condition, a queue, a sleep, a socket) is counted as
waiting. A second recording per stub keeps only the samples that hold the GIL (`--gil`): how much of
the wall time each category holds it, i.e. what contends for it. The table shows each stub's share
per category, its GIL time and its busiest functions (self samples). The
figures go to docs/benchmarks.md; `--keep DIR` keeps the raw py-spy files (flamegraph input).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.pd_ab import machine, servers, stream  # noqa: E402

WAITS = ("Condition.wait", "Event.wait", "sleep", "_wait_open", "select", "poll (", "SimpleQueue.get",
         "queue.py", "socket.py", "recv", "exit_when_orphaned", "orchestrator.py:302",
         "sending.py:108")  # an innermost frame that only waits (the last three: a C-level wait there)
CATEGORIES = (  # first match wins, checked innermost frame first
    ("model compute", ("rngd_pd/model/",)),
    ("kv transport", ("rngd_pd/kv/",)),
    ("responses", ("stubs/sending.py", "pbutils.py", "c_python_backend_utils")),
    ("orchestration", ("engine/orchestrator.py", "stubs/clients.py", "wire/inputs.py", "pd_model.py")),
    ("engine host work", ("rngd_pd/engine/", "model/sampling", "model/tokenizer", "tokenizers")),
)


def parse_raw(text: str) -> tuple[Counter, Counter, int]:
    """(samples per category, self samples per function, total) from py-spy's raw (collapsed) output."""
    cats: Counter = Counter()
    funcs: Counter = Counter()
    total = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        funcs[frames[-1]] += n
        if any(w in frames[-1] for w in WAITS):
            cats["waiting"] += n
            continue
        for frame in reversed(frames):
            cat = next((c for c, marks in CATEGORIES if any(m in frame for m in marks)), None)
            if cat is not None:
                cats[cat] += n
                break
        else:
            cats["other"] += n
    return cats, funcs, total


def load(url: str, streams: int, stop: threading.Event, prompt_len: int, max_tokens: int,
         done: list[int]) -> list[threading.Thread]:
    """`streams` closed-loop clients of unique prompts until `stop`."""
    def client(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            ids = [rng.randrange(1000, 40000) for _ in range(prompt_len)]
            try:
                done.append(len(stream(url, ids, max_tokens)[1]))
            except Exception as exc:  # reported, the profile goes on
                print(f"request failed: {exc}", file=sys.stderr)
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    return threads


def profile(server_pid: int, seconds: float, out_dir: Path) -> dict[str, dict]:
    from rngd_pd.host.stubs import stub_processes

    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if spy is None:
        raise SystemExit("py-spy is not installed: pip install py-spy (it is in the test extras)")
    procs = {}
    for stub in stub_processes(server_pid):
        if stub.completes_config:
            continue
        for mode in ("all", "gil"):  # every thread's samples, and only those holding the GIL
            path = out_dir / f"{stub.instance}.{mode}.raw"
            procs[(stub.instance, mode)] = (path, subprocess.Popen(
                [spy, "record", "--pid", str(stub.pid), "--duration", str(int(seconds)), "--format", "raw",
                 "--nonblocking", "--output", str(path), *(["--gil"] if mode == "gil" else [])],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    result: dict[str, dict] = {}
    for (name, mode), (path, proc) in procs.items():
        _, err = proc.communicate(timeout=seconds + 60)
        entry = result.setdefault(name, {})
        if proc.returncode != 0 or not path.exists():
            entry["error"] = err.decode(errors="replace")[-300:]
            continue
        cats, funcs, total = parse_raw(path.read_text())
        if mode == "all":
            entry.update(samples=total,
                         share={c: cats[c] / total for c in [*dict(CATEGORIES), "other", "waiting"] if total},
                         top=[(f, n / total) for f, n in funcs.most_common(8)] if total else [])
        else:  # the GIL's holders, as a share of the wall time sampled (100 samples a second)
            held = seconds * 100
            names = [*dict(CATEGORIES), "other", "waiting"]
            entry.update(gil_held=total / held, gil_by={c: cats[c] / held for c in names if cats[c]})
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="8,16")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--keep", type=Path, default=None, help="keep the raw py-spy files here")
    args = ap.parse_args(argv)
    rows = []
    with servers({"profiled": {}}) as started, tempfile.TemporaryDirectory(prefix="rngd-pd-prof-") as tmp:
        server, repo = started["profiled"], Path(tmp)
        stream(server.grpc_url, list(range(1000, 1000 + args.prompt_len)), 4)  # warm-up
        for n in (int(s) for s in args.streams.split(",")):
            stop, done = threading.Event(), []
            threads = load(server.grpc_url, n, stop, args.prompt_len, args.max_tokens, done)
            time.sleep(5)  # let the batch fill
            out_dir = args.keep / f"streams-{n}" if args.keep else repo / f"prof-{n}"
            out_dir.mkdir(parents=True, exist_ok=True)
            t0, before = time.monotonic(), sum(done)
            assert server.proc is not None
            stubs = profile(server.proc.pid, args.seconds, out_dir)
            tok_s = (sum(done) - before) / (time.monotonic() - t0)
            stop.set()
            for t in threads:
                t.join(timeout=300)
            rows.append({"streams": n, "output_tok_s_finished": tok_s, "stubs": stubs})
    print(f"machine: {machine()}")
    for row in rows:
        print(f"\n{row['streams']} streams ({row['output_tok_s_finished']:.0f} output tokens/s of finished "
              "requests while sampled)")
        for name, s in row["stubs"].items():
            if "error" in s:
                print(f"  {name}: py-spy failed: {s['error']}")
                continue
            share = ", ".join(f"{c} {v:.0%}" for c, v in s["share"].items() if v >= 0.005)
            print(f"  {name} ({s['samples']} samples of all threads): {share}")
            gil = ", ".join(f"{c} {v:.0%}" for c, v in s.get("gil_by", {}).items() if v >= 0.005)
            print(f"      GIL held {s.get('gil_held', 0):.0%} of the time: {gil}")
            for func, v in s["top"][:5]:
                print(f"      {v:5.1%}  {func}")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
