"""Weights while serving: one shared copy, variant swap against a full reload, a 3-tensor delta.

    .venv/bin/python bench/delta_bench.py [--model embedded|llama-3.1-8b] [--dir DIR] [--out DIR] [--json]

For the chosen model the bench writes a Hugging Face checkpoint (embedded: SmolLM2 exported to bf16
safetensors; llama-3.1-8b: Llama-3.1-8B's shape with random bf16 weights, ~16 GB) and a copy of it in
which three tensors changed, then starts one tritonserver (prefill, decode, pd; cpu config, bf16,
explicit model control, its own weight store root) on the first and measures:

* memory: RSS and PSS of the prefill and decode stubs, in all and of the weight store's mappings
  (one copy shared: each stub's PSS of the store is about half of it);
* variant swap (`rngd-pd swap`, decode num_slots 8 -> 16, the new instance maps the store): seconds
  from the command to the first decoded token on the new variant, against a full reload (embedded
  model: the same swap with weight_store=false, the new instance reads and converts the checkpoint;
  both models: the store's build at start, the whole checkpoint read and converted once), then back;
* partial update (`rngd-pd apply-delta`): checkpoint bytes read and converted, bytes hashed to
  compare, seconds, and the switch's steps, against the full reload's bytes and seconds.

It prints a table, writes JSON lines, and saves both with the host's load average under --out
(default bench/results/delta-<date>-<model>/). The 8B run needs ~40 GB of disk for the two
checkpoints and ~18 GB of memory (the store, 16 GB, shared; decode runs with pack_weights=false,
since packed decode weights are a second 16 GB copy): run it only on a quiet host.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
import uuid
from datetime import date
from pathlib import Path

import torch

from rngd_pd.host.shm_refs import Root
from rngd_pd.serve.model_control import first_token, swap
from rngd_pd.serve.server import ServerConfig, TritonServer
from rngd_pd.testing import e2e as E
from rngd_pd.testing.checkpoints import LLAMA_31_8B, changed_copy, export_embedded, random_checkpoint
from rngd_pd.wire.weights import apply_delta

CHANGED = {
    "embedded": ["model.layers.3.self_attn.k_proj.weight", "model.layers.7.mlp.up_proj.weight",
                 "model.layers.20.self_attn.o_proj.weight"],
    "llama-3.1-8b": ["model.layers.3.self_attn.k_proj.weight", "model.layers.17.mlp.up_proj.weight",
                     "model.layers.30.self_attn.o_proj.weight"],
}
EXPLICIT = ("--model-control-mode=explicit", "--load-model=*")


def progress(msg: str) -> None:
    print(f"  .. {msg}", file=sys.stderr, flush=True)


def checkpoints(model: str, d: Path) -> tuple[Path, Path]:
    base = d / f"{model}-base"
    if not (base / "config.json").exists():
        progress(f"writing {base}")
        if model == "embedded":
            export_embedded(base, torch.bfloat16)
        else:
            random_checkpoint(base, LLAMA_31_8B, torch.bfloat16)
    new = d / f"{model}-changed"
    if not new.exists():
        progress(f"writing {new} ({len(CHANGED[model])} tensors changed)")
        changed_copy(base, new, CHANGED[model])
    return base, new


def memory(pid: int, root: str) -> dict[str, int]:
    """MiB of RSS and PSS of a process, in all and of its mappings under the store root."""
    out = {"rss_mib": 0, "pss_mib": 0, "store_rss_mib": 0, "store_pss_mib": 0}
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):
            inside = root in line
        elif first in ("Rss:", "Pss:"):
            kb = int(line.split()[1])
            key = first[:-1].lower()
            out[f"{key}_mib"] += kb
            if inside:
                out[f"store_{key}_mib"] += kb
    return {k: v >> 10 for k, v in out.items()}


def settle(server_pid: int, model: str, timeout_s: float = 600.0) -> None:
    """Wait until `model` has one stub: the variant a swap replaced has unloaded. (A reload that began
    while the previous one's old instance was still unloading ended in a SIGSEGV of tritonserver
    2.51 once here; not investigated further.)"""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            E.stub_pid(server_pid, model)
            return
        except AssertionError:
            time.sleep(0.5)
    raise RuntimeError(f"{model} still has more than one stub after {timeout_s:.0f} s")


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def run(model: str, d: Path, out: Path) -> list[dict]:
    base, new = checkpoints(model, d)
    root = f"/dev/shm/rngd-pd-bench-weights-{uuid.uuid4().hex[:8]}"
    kv = tempfile.mkdtemp(prefix="rngd-pd-bench-shm-", dir="/dev/shm")
    env = {"AIRM_KV_TRANSPORT": "shm", "PD_SHM_ROOT": kv, "RNGD_PD_WEIGHT_STORE": root,
           "RNGD_PD_MODEL": str(base), "RNGD_PD_DTYPE": "bf16", "RNGD_PD_PARAM_LOCAL_PREFILL_TOKENS": "0",
           "RNGD_PD_PARAM_MAX_LEN": "1024"}
    if model != "embedded":
        env["RNGD_PD_PARAM_PACK_WEIGHTS"] = "false"
    rows: list[dict] = []
    cfg = ServerConfig(E.subset_repository(("prefill", "decode", "pd")), "cpu", http_port=0, grpc_port=0,
                       metrics_port=0, env=env, extra_args=EXPLICIT)
    server = TritonServer(cfg, log=out / "tritonserver.log")
    try:
        t0 = time.monotonic()
        server.start()
        server.wait_ready(3600)
        rows.append({"what": "server start (store built once, mapped by both)",
                     "seconds": time.monotonic() - t0})
        first_token(server.http_url)
        full_bytes = checkpoint_bytes(base)
        for m in ("prefill", "decode"):
            rows.append({"what": f"memory {m}", **memory(E.stub_pid(server.proc.pid, m), root)})
        log = (out / "tritonserver.log").read_text()
        built = re.search(r"weight store \S+: built, .* in ([\d.]+) s", log)
        rows.append({"what": "full load: the store built (whole checkpoint read and converted once)",
                     "seconds": float(built.group(1)) if built else None, "bytes_read": full_bytes})
        variants = [("swap, maps the store", {"num_slots": "16"})]
        if model == "embedded":  # an 8B model's private copy beside the store would not fit 24 GiB
            variants.append(("full reload (weight_store=false)", {"num_slots": "8", "weight_store": "false"}))
        variants.append(("swap back, maps the store", {"num_slots": "8", "weight_store": "true"}))
        for label, params in variants:
            progress(label)
            settle(server.proc.pid, "decode")
            r = swap(server.http_url, "decode", params)
            row = {"what": label, "params": params, "load_s": r.load_s, "first_token_s": r.first_token_s}
            if "false" in params.values():
                row["bytes_read"] = full_bytes
            rows.append(row)
        progress("apply-delta")
        report = apply_delta(server.http_url, str(new))
        rows.append({"what": f"delta ({len(report['changed'])} tensors)", "seconds": report["seconds_total"],
                     "bytes_read": report["bytes_read"], "bytes_hashed": report["bytes_hashed"],
                     "bytes_written": report["bytes_written"], "bytes_shared": report["bytes_shared"],
                     "steps_s": report["steps_s"]})
        rows.append({"what": "first token after the delta", "first_token_s": first_token(server.http_url)})
    finally:
        server.stop()
        shutil.rmtree(kv, ignore_errors=True)
        Root(root).sweep()
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| what | seconds | first token s | MiB read | other |", "|---|---|---|---|---|"]
    shown = ("what", "seconds", "load_s", "first_token_s", "bytes_read")
    for r in rows:
        secs, ftt = r.get("seconds", r.get("load_s")), r.get("first_token_s")
        other = {k: v for k, v in r.items() if k not in shown}
        cells = [r["what"], "" if secs is None else f"{secs:.2f}", "" if ftt is None else f"{ftt:.2f}",
                 str(r["bytes_read"] >> 20) if "bytes_read" in r else "", json.dumps(other) if other else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(CHANGED), default="embedded")
    p.add_argument("--dir", type=Path, default=None, help="where the checkpoints go (default: a temp dir)")
    p.add_argument("--out", type=Path, default=None, help="results directory")
    p.add_argument("--json", action="store_true", help="print JSON lines instead of the table")
    args = p.parse_args()
    out = args.out or Path(__file__).parent / "results" / f"delta-{date.today()}-{args.model}"
    out.mkdir(parents=True, exist_ok=True)
    d = args.dir or Path(tempfile.mkdtemp(prefix="rngd-pd-delta-bench-"))
    load_before = os.getloadavg()
    try:
        rows = run(args.model, d, out)
    finally:
        if args.dir is None:
            shutil.rmtree(d, ignore_errors=True)
    meta = {"model": args.model, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
            "date": str(date.today()), "cpus": os.cpu_count()}
    (out / "results.jsonl").write_text("\n".join(json.dumps({**meta, **r}) for r in rows) + "\n")
    text = table(rows)
    (out / "table.md").write_text(f"load average before {load_before}, after {meta['loadavg_after']} "
                                  f"({os.cpu_count()} CPUs)\n\n{text}\n")
    print("\n".join(json.dumps(r) for r in rows) if args.json else text)
    print(f"results: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
