"""Device conformance: a device's runtime against the torch CPU reference, shape by shape.

    .venv/bin/python -m rngd_pd.commands.device_conformance cpu|cuda|rngd|atom [--compile-only] [--json]

Checks, for every configured shape (prefill chunks; decode batch width x sequence bucket):

* prefill: the last token's logits and every layer's K/V within tolerance of the reference, for a
  prompt that fills the chunk and one that needs two chunks;
* decode: greedy tokens equal to the reference's over `--steps` steps, every row of the width at
  its own length;
* KV: host -> device -> host byte-exact, through a cache slot as decode loads it.

The reference computes in fp32 on the CPU; the device in `--dtype` (fp32 by default: tokens must
then be equal). `rngd --compile-only` compiles every graph with the Furiosa compiler inside
`.venv-rngd` (it says to run `make rngd-env` when that is missing) and checks nothing numeric: for
hosts without a card. `--stage import` (the default) stops where the compiler accepts or refuses each
op (seconds a graph); `--stage compile` goes to the binary (minutes a graph on 2 cores:
docs/devices-rngd.md). Exits 1 on any failure, 2 when the device cannot be used
here; prints what it checked either way.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rngd_pd.config.dtypes import COMPUTE_DTYPES, KV_DTYPES, torch_dtype
from rngd_pd.devices import select_device
from rngd_pd.devices.binding import runtime_for
from rngd_pd.devices.rngd.runtime import compile_check, configured_shapes
from rngd_pd.devices.runtime import DEFAULT_SHAPES, DeviceRuntime, GraphShapes
from rngd_pd.devices.torch_runtime import as_runtime
from rngd_pd.engine.prefill import PrefillEngine
from rngd_pd.errors import DeviceUnavailableError
from rngd_pd.model import load_model
from rngd_pd.model.sampling import SamplingParams


@dataclass
class Check:
    """One line of the report."""

    name: str
    shape: str
    ok: bool
    detail: str = ""
    seconds: float = 0.0


def parse_decode(text: str) -> tuple[tuple[int, int], ...]:
    """`1x512,8x2048` -> ((1, 512), (8, 2048))."""
    out = []
    for part in filter(None, text.split(",")):
        b, _, n = part.partition("x")
        out.append((int(b), int(n)))
    return tuple(out)


def _timed(name: str, shape: str, fn: Callable[[], tuple[bool, str]]) -> Check:
    t0 = time.perf_counter()
    try:
        ok, detail = fn()
    except Exception as exc:  # a check that raises has failed; the others still run
        ok, detail = False, f"{type(exc).__name__}: {exc}"
    return Check(name, shape, ok, detail, round(time.perf_counter() - t0, 3))


def _prompt(tokenizer: Any, n: int, seed: int) -> list[int]:
    text = " ".join(f"item {seed}-{i} of the list of things to check on a device," for i in range(n))
    return tokenizer.encode(text)[:n]


def _close(ref: Any, got: Any, atol: float, rtol: float) -> tuple[bool, float]:
    import torch

    a, b = ref.float().cpu(), got.float().cpu()
    diff = float((a - b).abs().max()) if a.numel() else 0.0
    return bool(torch.allclose(a, b, atol=atol, rtol=rtol)), diff


def check_prefill(dev: DeviceRuntime, ref: DeviceRuntime, chunk: int, atol: float,
                  rtol: float) -> list[Check]:
    """One prompt filling the chunk, one of 1.5 chunks (run in two: the chunked path)."""
    checks = []
    params = SamplingParams(max_tokens=1)
    for n in (chunk, chunk + chunk // 2):
        ids = _prompt(ref.loaded.tokenizer, n, n)

        def run(ids: list[int] = ids) -> tuple[bool, str]:
            want = PrefillEngine(ref, "fp32", chunk).prefill("ref", ids, params)
            got = PrefillEngine(dev, "fp32", chunk).prefill("dev", ids, params)
            worst, bad = 0.0, []
            for i, ((rk, rv), (gk, gv)) in enumerate(zip(want.kv, got.kv, strict=True)):
                for name, a, b in (("K", rk, gk), ("V", rv, gv)):
                    ok, d = _close(a, dev.to_host(b), atol, rtol)
                    worst = max(worst, d)
                    if not ok:
                        bad.append(f"layer {i} {name} max|diff| {d:.3g}")
            same = want.first_token == got.first_token
            detail = f"first token {got.first_token} (ref {want.first_token}); KV max|diff| {worst:.3g}"
            return same and not bad, detail + ("; " + ", ".join(bad[:3]) if bad else "")

        checks.append(_timed("prefill", f"chunk {chunk}, prompt {len(ids)}", run))
    return checks


def check_decode(dev: DeviceRuntime, ref: DeviceRuntime, width: int, bucket: int, steps: int,
                 chunk: int = 512, kv_dtype: Any = "fp32") -> Check:
    """`width` rows of different lengths decoded together; every row's greedy tokens must equal
    the reference's for the same row decoded the same way (prompts prefilled in chunks of `chunk`,
    the graphs a static-shape device prepared; KV in `kv_dtype` on both sides)."""
    def run() -> tuple[bool, str]:
        lengths = [max(2, min(bucket - steps - 1, 8 + 13 * r)) for r in range(width)]
        prompts = [_prompt(ref.loaded.tokenizer, n, 100 + r) for r, n in enumerate(lengths)]
        results = []
        for rt in (ref, dev):
            pre = PrefillEngine(rt, kv_dtype, chunk)
            params = SamplingParams(max_tokens=steps + 1)
            with rt.inference():
                cache = rt.new_cache(width, bucket, kv_dtype)
                firsts = []
                for slot, ids in enumerate(prompts):
                    out = pre.prefill(f"c{slot}", ids, params)
                    cache.load_all(slot, out.kv)
                    firsts.append(out.first_token)
                host, idx = rt.step_buffers(width)
                tokens, positions = list(firsts), [len(p) for p in prompts]
                rows = [[t] for t in firsts]
                for _ in range(steps):
                    host[0, :width], host[1, :width], host[2, :width] = tokens, positions, range(width)
                    logits = rt.decode_step(idx[0, :width], idx[1, :width], cache, idx[2, :width])
                    tokens = logits.argmax(dim=-1).tolist()
                    positions = [p + 1 for p in positions]
                    for r, t in enumerate(tokens):
                        rows[r].append(t)
            results.append(rows)
        want, got = results
        bad = [r for r in range(width) if want[r] != got[r]]
        if bad:
            r = bad[0]
            return False, f"rows {bad} differ; row {r}: {got[r]} vs ref {want[r]}"
        return True, f"{width} rows x {steps} steps equal (lengths {lengths[0]}..{lengths[-1]})"

    return _timed("decode", f"width {width}, bucket {bucket}", run)


def check_kv_roundtrip(dev: DeviceRuntime, width: int, bucket: int, kv_dtype: str) -> Check:
    """Random bytes in the KV dtype: host -> device -> host, and through a cache slot."""

    def run() -> tuple[bool, str]:
        import torch

        c = dev.loaded.config
        gen = torch.Generator().manual_seed(width * 7919 + bucket)
        n = min(bucket, 64)
        host = torch.randn(c.num_kv_heads, n, c.head_dim, generator=gen).to(dev.dtype(kv_dtype))
        back = dev.to_host(dev.to_device(host))
        if not torch.equal(back.view(torch.uint8), host.view(torch.uint8)):
            return False, "to_device -> to_host changed bytes"
        cache = dev.new_cache(width, bucket, kv_dtype)
        slot = width - 1
        cache.load(slot, c.num_layers - 1, host, host, start=bucket - n)
        stored = dev.to_host(cache.read(slot, c.num_layers - 1, bucket - n, bucket)[0])
        if not torch.equal(stored.contiguous().view(torch.uint8), host.view(torch.uint8)):
            return False, "a slot's K read back differs from what was loaded"
        return True, f"{host.numel() * host.element_size()} bytes exact ({kv_dtype})"

    return _timed("kv", f"width {width}, bucket {bucket}", run)


def run_checks(dev: DeviceRuntime, ref: DeviceRuntime, shapes: GraphShapes, steps: int,
               atol: float, rtol: float) -> list[Check]:
    checks = []
    prep = _timed("prepare", "all", lambda: (dev.prepare(shapes) is None, shapes.describe()))
    checks.append(prep)
    if not prep.ok:
        return checks
    for chunk in shapes.prefill_chunks:
        checks += check_prefill(dev, ref, chunk, atol, rtol)
    chunk = max(shapes.prefill_chunks)
    for width, bucket in shapes.decode:
        checks.append(check_decode(dev, ref, width, bucket, steps, chunk, shapes.kv_dtype))
        checks.append(check_kv_roundtrip(dev, width, bucket, shapes.kv_dtype))
    return checks


def device_runtime(kind: str, device_id: int, dtype: str) -> tuple[DeviceRuntime, DeviceRuntime]:
    """(the device's runtime, the CPU fp32 reference), each with its own copy of the weights."""
    import torch

    device = select_device(kind, device_id)  # raises naming the missing SDK / card
    dev = runtime_for(device, load_model(None, dtype=torch_dtype(dtype), progress=False))
    ref = as_runtime(load_model(None, dtype=torch.float32, progress=False))
    return dev, ref


def compile_scope(stage: str) -> str:
    """What `rngd --compile-only --stage <stage>` checked, in one sentence (printed with the table)."""
    graphs = ("every graph the shapes need: per shape one decoder layer (its weights as inputs, run "
              "once per layer of the model) and the LM head")
    return {"import": f"furiosa's decompositions + DFG import (where ops are refused) of {graphs}",
            "lower": f"import + lowering of {graphs}",
            "compile": f"the whole compiler, down to the binary, of {graphs}",
            }[stage] + ". Nothing runs: no card"


def compile_only(kind: str, shapes: GraphShapes, stage: str = "import", per_graph_timeout: float = 7200.0,
                 no_cache: bool = False, max_unique_shapes: int | None = None) -> list[Check]:
    """Take every graph through the card's compiler on a host that may have none (rngd only), up to
    `stage` (import: every op accepted, seconds a graph; compile: the binary, minutes a graph on 2
    cores). `no_cache`: a real compile, not furiosa's cache; `max_unique_shapes`: a bounded tactic
    search (rngd.runtime.compile_check)."""
    if kind != "rngd":
        raise DeviceUnavailableError(f"--compile-only is for rngd (its compiler runs without a card); "
                                     f"{kind} needs its hardware for conformance")

    checks = []
    for r in compile_check(shapes, stage=stage, per_graph_timeout=per_graph_timeout, no_cache=no_cache,
                           max_unique_shapes=max_unique_shapes):
        secs = r.get("seconds") or {}
        total = secs.get("total", sum(secs.values())) if isinstance(secs, dict) else float(secs)
        refused = ", ".join(r.get("refused_ops") or [])
        detail = r.get("error") or (f"refused: {refused}" if refused else f"reached {r.get('stage')}")
        if r.get("ok") and r.get("binary_bytes"):
            detail += f", binary {r['binary_bytes']} bytes"
        if r.get("max_unique_shapes"):
            detail += f", tactic search bounded to {r['max_unique_shapes']} shapes"
        sdk = ", ".join(f"{k} {v}" for k, v in (r.get("sdk") or {}).items())
        name = f"{r.get('graph', 'graph')}_{r.get('part', 'graph')}@{stage}"
        checks.append(Check(name, str(r.get("shape", "")), bool(r.get("ok")),
                            f"{detail} ({sdk})" if sdk else detail, round(total, 1)))
    return checks


def format_table(kind: str, checks: Sequence[Check]) -> str:
    width = max([len(c.shape) for c in checks] + [5])
    names = max([len(c.name) for c in checks] + [8])
    lines = [f"device conformance: {kind}",
             f"  {'check':<{names}} {'shape':<{width}} {'result':<6} {'s':>7}  detail"]
    for c in checks:
        result = "ok" if c.ok else "FAIL"
        lines.append(f"  {c.name:<{names}} {c.shape:<{width}} {result:<6} {c.seconds:>7.2f}  {c.detail}")
    failed = sum(not c.ok for c in checks)
    lines.append(f"{len(checks)} checks, {failed} failed" + ("" if failed else f": {kind} conforms"))
    return "\n".join(lines)


HELP = "check a device's graphs against the torch CPU reference, shape by shape (cpu, cuda, rngd, atom)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("device", choices=("cpu", "cuda", "rngd", "atom"))
    p.add_argument("--device-id", type=int, default=-1, help="card ordinal; -1 = the allocated / first one")
    p.add_argument("--compile-only", action="store_true", help="rngd: compile every graph, run nothing")
    p.add_argument("--stage", default="import", choices=("import", "lower", "compile"),
                   help="--compile-only: how far the compiler goes (import: every op accepted; compile: "
                        "down to the binary)")
    p.add_argument("--no-cache", action="store_true", help="--compile-only: bypass furiosa's compile cache")
    p.add_argument("--timeout", type=float, default=7200.0, help="--compile-only: seconds per graph")
    p.add_argument("--max-unique-shapes", type=int, default=None,
                   help="--compile-only: bound the compiler's tactic search (e.g. 16: a layer compiles "
                        "several times faster; its tactics may run slower on a card)")
    p.add_argument("--chunks", default=",".join(map(str, DEFAULT_SHAPES.prefill_chunks)),
                   help="prefill chunk lengths")
    p.add_argument("--past", default="",
                   help="--compile-only: past buckets of a prefill chunk after earlier chunks, e.g. 512,1024 "
                        "(on a card the prefill engine prepares its own)")
    p.add_argument("--decode", default=",".join(f"{b}x{n}" for b, n in DEFAULT_SHAPES.decode),
                   help="decode shapes WIDTHxBUCKET, comma-separated")
    p.add_argument("--config-shapes", action="store_true",
                   help="rngd: the shapes the model repository's rngd configs need (prefill chunk_size, "
                        "every decode bucket of decode/configs/rngd.pbtxt) instead of --chunks/--decode")
    p.add_argument("--dtype", default=None, choices=COMPUTE_DTYPES,
                   help="compute dtype (default: bf16 for rngd, whose graphs are bf16; else fp32)")
    p.add_argument("--kv-dtype", default="bf16", choices=KV_DTYPES)
    p.add_argument("--steps", type=int, default=8, help="decode steps per shape")
    p.add_argument("--atol", type=float, default=None, help="default: 1e-4 in fp32, 5e-2 in bf16")
    p.add_argument("--json", action="store_true", help="one JSON object per check instead of the table")


def run(args: argparse.Namespace) -> int:
    args.dtype = args.dtype or ("bf16" if args.device == "rngd" else "fp32")
    shapes = GraphShapes(tuple(int(c) for c in args.chunks.split(",") if c), parse_decode(args.decode),
                         args.dtype, args.kv_dtype, tuple(int(n) for n in args.past.split(",") if n))
    if args.config_shapes:
        shapes = dataclasses.replace(configured_shapes(), dtype=args.dtype, kv_dtype=args.kv_dtype)
    atol = args.atol if args.atol is not None else (1e-4 if args.dtype == "fp32" else 5e-2)
    try:
        if args.compile_only:
            print(f"rngd --compile-only --stage {args.stage}: {compile_scope(args.stage)}; "
                  f"shapes {shapes.describe()}", file=sys.stderr if args.json else sys.stdout, flush=True)
            checks = compile_only(args.device, shapes, args.stage, args.timeout, args.no_cache,
                                  args.max_unique_shapes)
        else:
            dev, ref = device_runtime(args.device, args.device_id, args.dtype)
            rtol = 1e-3 if args.dtype == "fp32" else 5e-2
            checks = run_checks(dev, ref, shapes, args.steps, atol, rtol)
    except DeviceUnavailableError as exc:
        print(f"device conformance: {args.device} cannot be checked here: {exc}", file=sys.stderr)
        return 2
    if args.json:
        for c in checks:
            print(json.dumps({"device": args.device, **asdict(c)}))
    else:
        print(format_table(args.device, checks))
    return 0 if checks and all(c.ok for c in checks) else 1



def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rngd-pd device-conformance", description=(__doc__ or "").split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
