"""Device conformance: a device's runtime against Hugging Face transformers, shape by shape.

    python -m rngd_pd.devices.conformance cpu|cuda|rngd|atom [--dtype bf16] [--json]
    rngd-pd device-conformance ...          (the same, plus `rngd --compile-only`: commands/)

The reference is transformers' own Llama on the same checkpoint, read by its own loader
(rngd_pd.model.reference), in the device's compute dtype, on the CPU: never this project's model, so
a wrong weight, layout or kernel anywhere in our path fails here (tests/test_device_conformance.py
breaks one weight in our loader and sees it fail). Checks, through the DeviceRuntime interface only,
for every configured shape (prefill chunks; decode batch width x sequence bucket):

* prefill: the last token's logits and every layer's K/V within tolerance of the reference's, for a
  prompt that fills the chunk and one that needs two chunks (the second after a past);
* decode: rows of different lengths prefilled and loaded into their cache slots, then `--steps`
  greedy steps, all at once; every step's logits within tolerance of the reference's for the same
  sequence (teacher forcing: the reference scores prompt + the device's tokens in one pass), and
  every token the reference's greedy one but where the reference's own top two are a near-tie. Each
  width runs full and, where wider than one, with fewer rows than its slots in scattered slots (what
  serving runs most of the time; a static-shape device pads those rows);
* KV: host -> device -> host byte-exact, through a cache slot as decode loads it.

Tolerances are per compute and KV dtype (`TOLERANCES`, measured against transformers: docs/devices.md).
Exits 1 on any failure, 2 when the device (or transformers) cannot be used here; prints what it
checked either way.
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

from rngd_pd.config.dtypes import COMPUTE_DTYPES, KV_DTYPES, short_dtype, torch_dtype
from rngd_pd.devices import select_device
from rngd_pd.devices.binding import runtime_for
from rngd_pd.devices.runtime import DEFAULT_SHAPES, DeviceRuntime, GraphShapes, KVList, past_buckets
from rngd_pd.errors import DeviceUnavailableError, ModelLoadError
from rngd_pd.model import load_model
from rngd_pd.model.reference import Reference


@dataclass
class Check:
    """One line of the report."""

    name: str
    shape: str
    ok: bool
    detail: str = ""
    seconds: float = 0.0


@dataclass(frozen=True)
class Tolerance:
    """How close a device must come to transformers.

    logits: max |logit - reference logit| at any checked position; kv: max |K - reference K| of a
    layer (and V) over the largest |reference K| of that layer (rounding scales with the values, and
    RoPE's differences of large products leave absolute errors on small results); tie: a greedy
    token may differ from the reference's only where the reference's own logit of it is within
    `tie` of its top one (a near-tie that rounding may flip)."""

    logits: float
    kv: float
    tie: float


# Measured against transformers on the embedded SmolLM2 with the default shapes (docs/devices.md,
# "Conformance" has the figures): the worst seen, then about 2x. fp32 compute with 16-bit KV rounds
# the K/V each later layer and step attends over; bf16 compute is compared with transformers in bf16.
TOLERANCES = {"fp32": Tolerance(logits=1e-3, kv=1e-4, tie=1e-3),
              "fp32, 16-bit KV": Tolerance(logits=0.3, kv=0.05, tie=0.3),
              "bf16": Tolerance(logits=1.5, kv=0.2, tie=1.0)}


def tolerance(dtype: Any, kv_dtype: Any) -> Tolerance:
    """The TOLERANCES row of a compute dtype and a KV dtype."""
    if short_dtype(dtype) == "bf16":
        return TOLERANCES["bf16"]
    return TOLERANCES["fp32" if short_dtype(kv_dtype) == "fp32" else "fp32, 16-bit KV"]


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


def prefill_chunked(dev: DeviceRuntime, ids: Sequence[int], chunk: int, kv_dtype: Any) -> tuple[Any, KVList]:
    """(host fp32 logits of the last token, host K/V per layer [kv_heads, T, head_dim]): the prompt
    in chunks of `chunk`, each after the K/V of the ones before (the device's past path)."""
    import torch

    kv: KVList = []
    logits = None
    with dev.inference():
        for start in range(0, len(ids), chunk):
            past = [(dev.to_device(k), dev.to_device(v)) for k, v in kv] if kv else None
            logits, new = dev.prefill(dev.tokens(ids[start:start + chunk]), past=past, kv_dtype=kv_dtype)
            host = [(dev.to_host(k), dev.to_host(v)) for k, v in new]
            kv = host if not kv else [(torch.cat([k, nk], 1), torch.cat([v, nv], 1))
                                      for (k, v), (nk, nv) in zip(kv, host, strict=True)]
    return dev.to_host(logits).float(), kv


def compare_tokens(got: Any, ref: Any) -> tuple[int, list[float]]:
    """(positions where the device's greedy token is not the reference's, the reference's margin
    at each of them: its top logit minus its logit of the device's token). got, ref: [N, vocab]."""
    mine = got.argmax(-1)
    theirs = ref.argmax(-1)
    rows = (mine != theirs).nonzero().flatten().tolist()
    margins = [float(ref[r, theirs[r]] - ref[r, mine[r]]) for r in rows]
    return len(rows), margins


def _verdict(got: Any, ref: Any, tol: Tolerance) -> tuple[bool, str]:
    """Logits within tol.logits, tokens the reference's but for near-ties; a one-line detail."""
    worst = float((got - ref).abs().max())
    n, margins = compare_tokens(got, ref)
    far = [m for m in margins if m > tol.tie]
    detail = f"logits max|diff| {worst:.3g}; tokens {len(got) - n}/{len(got)} the reference's"
    if n:
        detail += f" ({n} differ, reference margins {', '.join(f'{m:.3g}' for m in margins[:4])})"
    ok = worst <= tol.logits and not far
    return ok, detail + ("" if worst <= tol.logits else f" > {tol.logits}")


def check_prefill(dev: DeviceRuntime, ref: Reference, chunk: int, kv_dtype: Any,
                  tol: Tolerance) -> list[Check]:
    """One prompt filling the chunk, one of 1.5 chunks (run in two: the past path)."""
    checks = []
    for n in (chunk, chunk + chunk // 2):
        ids = _prompt(dev.loaded.tokenizer, n, n)

        def run(ids: list[int] = ids) -> tuple[bool, str]:
            logits, kv = prefill_chunked(dev, ids, chunk, kv_dtype)
            want_logits, want_kv = ref.score(ids)
            ok, detail = _verdict(logits[None], want_logits[-1:], tol)
            worst, bad = 0.0, []
            for i, ((gk, gv), (rk, rv)) in enumerate(zip(kv, want_kv, strict=True)):
                for name, a, b in (("K", rk, gk), ("V", rv, gv)):
                    a, b = a.float(), b.float()
                    rel = float((a - b).abs().max() / a.abs().max().clamp_min(1e-6))
                    worst = max(worst, rel)
                    if rel > tol.kv:
                        bad.append(f"layer {i} {name} {rel:.3g}")
            detail += f"; KV max|diff|/max|ref| {worst:.3g}"
            if bad:
                detail += f", outside tolerance: {', '.join(bad[:3])}"
            return ok and not bad, detail

        checks.append(_timed("prefill", f"chunk {chunk}, prompt {len(ids)}", run))
    return checks


def scattered_slots(rows: int, width: int) -> list[int]:
    """`rows` distinct slots of `width`, spread out and in falling order (not 0..rows-1)."""
    return [width - 1 - (i * width) // rows for i in range(rows)]


def decode_lengths(width: int, bucket: int, steps: int) -> list[int]:
    """The prompt length of each row of a decode check (all different, each leaves room for steps)."""
    return [max(2, min(bucket - steps - 1, 8 + 13 * r)) for r in range(width)]


def decode_logits(dev: DeviceRuntime, prompts: Sequence[Sequence[int]], width: int, bucket: int, steps: int,
                  chunk: int, kv_dtype: Any, slots: Sequence[int],
                  forced: Sequence[Sequence[int]] | None = None) -> list[Any]:
    """Per row, host fp32 logits [steps + 1, vocab]: the prefill's (row r's prompt prefilled in chunks
    and loaded into cache slot slots[r] of `width`), then `steps` batched decode steps of all rows
    at once, each fed the row's greedy token, or forced[r][i] at step i (teacher forcing)."""
    import torch

    rows = len(prompts)
    seen: list[list[Any]] = [[] for _ in range(rows)]
    with dev.inference():
        cache = dev.new_cache(width, bucket, kv_dtype)
        for r, ids in enumerate(prompts):
            logits, kv = prefill_chunked(dev, ids, chunk, kv_dtype)
            cache.load_all(slots[r], kv)
            seen[r].append(logits)
        host, idx = dev.step_buffers(rows)
        positions = [len(p) for p in prompts]
        for i in range(steps):
            host[0, :rows] = [int(s[-1].argmax()) if forced is None else forced[r][i]
                              for r, s in enumerate(seen)]
            host[1, :rows], host[2, :rows] = positions, list(slots)
            out = dev.to_host(dev.decode_step(idx[0, :rows], idx[1, :rows], cache, idx[2, :rows]))
            for r in range(rows):
                seen[r].append(out[r].float())
            positions = [p + 1 for p in positions]
    return [torch.stack(s) for s in seen]


def check_decode(dev: DeviceRuntime, ref: Reference, width: int, bucket: int, steps: int, chunk: int,
                 kv_dtype: Any, tol: Tolerance, rows: int | None = None) -> Check:
    """`rows` (default: `width`) rows of different lengths in a cache of `width` slots, decoded
    together for `steps` greedy steps; each row's logits at every step (the prefill's first) against
    the reference scoring the row's whole sequence."""
    rows = width if rows is None else rows

    def run() -> tuple[bool, str]:
        import torch

        slots = list(range(width)) if rows == width else scattered_slots(rows, width)
        prompts = [_prompt(dev.loaded.tokenizer, n, 100 + r)
                   for r, n in enumerate(decode_lengths(rows, bucket, steps))]
        got = decode_logits(dev, prompts, width, bucket, steps, chunk, kv_dtype, slots)
        want = [ref.score(ids + row.argmax(-1).tolist()[:-1])[0][len(ids) - 1:]
                for ids, row in zip(prompts, got, strict=True)]
        ok, detail = _verdict(torch.cat(got), torch.cat(want), tol)
        where = f"rows {rows} of {width} in slots {slots}" if rows < width else f"{rows} rows"
        return ok, f"{where} x {steps + 1} positions: {detail}"

    shape = f"width {width}, bucket {bucket}" + (f", {rows} rows" if rows != width else "")
    return _timed("decode", shape, run)


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
        return True, f"{host.numel() * host.element_size()} bytes exact ({short_dtype(kv_dtype)})"

    return _timed("kv", f"width {width}, bucket {bucket}", run)


def with_past(shapes: GraphShapes, steps: int) -> GraphShapes:
    """`shapes` plus the past buckets the checks' prompts need where none of its own holds them (a
    static-shape device prepares a graph per past bucket, as the prefill engine plans them)."""
    longest = max([c + c // 2 for c in shapes.prefill_chunks]
                  + [max(decode_lengths(w, n, steps)) for w, n in shapes.decode])
    past = set(shapes.prefill_past)
    for chunk in shapes.prefill_chunks:
        need = (longest - 1) // chunk * chunk  # the past of the last chunk of the longest prompt
        if need and not any(b >= need for b in past):
            past |= set(past_buckets(chunk, need))
    return dataclasses.replace(shapes, prefill_past=tuple(sorted(past)))


def fewer_rows(width: int) -> int:
    """The row count of a partly filled width: about half (the row-padding branch of static graphs)."""
    return max(1, width // 2 - 1) if width > 2 else 1


def run_checks(dev: DeviceRuntime, ref: Reference, shapes: GraphShapes, steps: int,
               tol: Tolerance) -> list[Check]:
    shapes = with_past(shapes, steps)
    checks = []
    prep = _timed("prepare", "all", lambda: (dev.prepare(shapes) is None, shapes.describe()))
    checks.append(prep)
    if not prep.ok:
        return checks
    for chunk in shapes.prefill_chunks:
        checks += check_prefill(dev, ref, chunk, shapes.kv_dtype, tol)
    chunk = max(shapes.prefill_chunks)
    for width, bucket in shapes.decode:
        checks.append(check_decode(dev, ref, width, bucket, steps, chunk, shapes.kv_dtype, tol))
        if width > 1:
            checks.append(check_decode(dev, ref, width, bucket, steps, chunk, shapes.kv_dtype, tol,
                                       rows=fewer_rows(width)))
        checks.append(check_kv_roundtrip(dev, width, bucket, shapes.kv_dtype))
    return checks


def device_runtime(kind: str, device_id: int, dtype: str,
                   model: str | None = None) -> tuple[DeviceRuntime, Reference]:
    """(the device's runtime, transformers on the same checkpoint in the same compute dtype);
    `model`: a GGUF file or checkpoint directory (None: the embedded model)."""
    device = select_device(kind, device_id)  # raises naming the missing SDK / card
    try:
        ref = Reference.load(model, dtype)
    except ModelLoadError as exc:
        raise DeviceUnavailableError(f"no reference: {exc}") from None
    return runtime_for(device, load_model(model, dtype=torch_dtype(dtype), progress=False)), ref


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


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The numeric checks' arguments (commands/device_conformance.py adds the compile-only ones)."""
    p.add_argument("device", choices=("cpu", "cuda", "rngd", "atom"))
    p.add_argument("--device-id", type=int, default=-1, help="card ordinal; -1 = the allocated / first one")
    p.add_argument("--chunks", default=",".join(map(str, DEFAULT_SHAPES.prefill_chunks)),
                   help="prefill chunk lengths")
    p.add_argument("--past", default="",
                   help="past buckets of a prefill chunk after earlier chunks, e.g. 512,1024 (default: "
                        "what the checks' prompts need)")
    p.add_argument("--decode", default=",".join(f"{b}x{n}" for b, n in DEFAULT_SHAPES.decode),
                   help="decode shapes WIDTHxBUCKET, comma-separated")
    p.add_argument("--dtype", default=None, choices=COMPUTE_DTYPES,
                   help="compute dtype, of the device and of the reference (default: bf16 for rngd, whose "
                        "graphs are bf16; else fp32)")
    p.add_argument("--kv-dtype", default="bf16", choices=KV_DTYPES)
    p.add_argument("--steps", type=int, default=8, help="decode steps per shape")
    p.add_argument("--logits-atol", type=float, default=None,
                   help="max |logit diff| (default: TOLERANCES of the compute and KV dtypes)")
    p.add_argument("--model", default=None,
                   help="GGUF file or checkpoint directory (default: the embedded model)")
    p.add_argument("--json", action="store_true", help="one JSON object per check instead of the table")


def shapes_of(args: argparse.Namespace) -> GraphShapes:
    args.dtype = args.dtype or ("bf16" if args.device == "rngd" else "fp32")
    return GraphShapes(tuple(int(c) for c in args.chunks.split(",") if c), parse_decode(args.decode),
                       args.dtype, args.kv_dtype, tuple(int(n) for n in args.past.split(",") if n))


def report(kind: str, checks: Sequence[Check], as_json: bool) -> int:
    """Print the checks (table or JSON lines); the exit status: 0 when all passed, else 1."""
    if as_json:
        for c in checks:
            print(json.dumps({"device": kind, **asdict(c)}))
    else:
        print(format_table(kind, checks))
    return 0 if checks and all(c.ok for c in checks) else 1


def run(args: argparse.Namespace, shapes: GraphShapes | None = None) -> int:
    shapes = shapes or shapes_of(args)
    tol = tolerance(shapes.dtype, shapes.kv_dtype)
    if args.logits_atol is not None:
        tol = dataclasses.replace(tol, logits=args.logits_atol)
    try:
        dev, ref = device_runtime(args.device, args.device_id, short_dtype(shapes.dtype), args.model)
    except DeviceUnavailableError as exc:
        print(f"device conformance: {args.device} cannot be checked here: {exc}", file=sys.stderr)
        return 2
    return report(args.device, run_checks(dev, ref, shapes, args.steps, tol), args.json)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rngd_pd.devices.conformance",
                                description=(__doc__ or "").split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
