"""FuriosaAI RNGD: the compiler check (runs here) and the runtime (needs a card).

furiosa-torch 2026.4.0 pins torch 2.10 and numpy >= 2.2.6, so it lives in its own environment,
`.venv-rngd` (`make rngd-env`), never in the serving one (torch 2.13, numpy < 2 for Triton 2.51).
This module is imported in the serving environment and never imports furiosa: everything that
needs the SDK runs in a `.venv-rngd` subprocess, `python -m rngd_pd.devices.rngd.graphs`.

    rows = compile_check(GraphShapes(prefill_chunks=(128, 512), decode=((1, 512), (8, 2048))))
    # one dict per graph: name, shape, dtype, sdk versions, ok, seconds, stage, error, refused_ops

What is verified on a host without a card (docs/devices-rngd.md has the figures): the environment
builds; our prefill and decode graphs export and go through furiosa's own decompositions; the
compiler runs to the end once an aarch64 cross compiler is installed (it builds the PEs' C code with
`aarch64-linux-gnu-gcc`; without it every compile fails with "No such file or directory (os error 2)").

What is NOT verified (no card, no driver here): furiosa's side of the card. `RngdRuntime` drives
a `.venv-rngd` worker (`rngd.graphs --serve`, a `CardWorker`) that loads the compiled graphs onto
`furiosa:N` (`CompileModule.from_exported(...).to(device)`, then calls them), written against
furiosa-torch 2026.4's installed sources, never run on a card. The rest of that path (this runtime,
the messages, the worker's padding, chunk and past buckets, layer-by-layer chains and cache) runs
in tests with the same graphs compiled by torch.export on the CPU and passes device conformance
against the CPU reference (tests/test_devices_rngd.py). Where the card or driver is missing,
`RngdRuntime(...)` raises DeviceUnavailableError naming it; it never computes on the CPU.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rngd_pd.config.dtypes import AUTO, lookup, short_dtype, torch_dtype
from rngd_pd.devices.base import Device, unavailable
from rngd_pd.devices.cpu_features import choose_compute_dtype
from rngd_pd.devices.npu import RNGD, cards
from rngd_pd.devices.rngd.artifacts import DEFAULT_SEARCH, CompileOptions, search_label
from rngd_pd.devices.rngd.env import MAKE_HINT, repo_root, require_rngd_python, rngd_env, rngd_python
from rngd_pd.devices.rngd.messages import pack_message, read_message
from rngd_pd.devices.runtime import (
    DEFAULT_SHAPES,
    GraphShapes,
    KVList,
    MemoryInfo,
    OnLayer,
    decode_shapes,
    prefill_shapes,
    step_parts_in_turn,
)
from rngd_pd.errors import ConfigError, RngdPdError
from rngd_pd.host.children import killed_with_parent
from rngd_pd.model.checkpoint import open_checkpoint

DRIVER_LIB = "renegade"  # librenegade.so, the HAL library of the RNGD driver (the SDK panics without it)
_GRAPHS = "rngd_pd.devices.rngd.graphs"


# ---------------------------------------------------------------- compile check (runs here)


def graph_args(shapes: GraphShapes) -> list[str]:
    """rngd.graphs command-line arguments for these shapes."""
    args = ["--chunks", ",".join(str(t) for t in shapes.prefill_chunks),
            "--past", ",".join(str(n) for n in shapes.prefill_past),
            "--decode", ",".join(f"{b}x{n}" for b, n in shapes.decode),
            "--dtype", short_dtype(shapes.dtype), "--kv-dtype", short_dtype(shapes.kv_dtype)]
    return args


_PARAM = re.compile(r'key:\s*"(\w+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"')
CONFIGS = ("rngd", "default")  # `rngd-pd compile --config`: configs/rngd.pbtxt, or each model's config.pbtxt


def pbtxt_parameters(path: Path) -> dict[str, str]:
    """The string parameters of a Triton config.pbtxt (`parameters { key: ... string_value: ... }`)."""
    return dict(_PARAM.findall(path.read_text()))


def model_configs(config: str = "rngd", root: Path | None = None) -> dict[str, Path]:
    """{model: the config file tritonserver loads} under `--model-config-name <config>`:
    <model>/configs/<config>.pbtxt where it exists, else <model>/config.pbtxt (as tritonserver
    falls back); "default": every model's config.pbtxt."""
    if config not in CONFIGS:
        raise ConfigError(f"config {config!r}: one of {', '.join(CONFIGS)}")
    repo = (root or repo_root()) / "model_repository"
    out = {}
    for main in sorted(repo.glob("*/config.pbtxt")):
        variant = main.parent / "configs" / f"{config}.pbtxt"
        out[main.parent.name] = variant if config != "default" and variant.exists() else main
    return out


def configured_shapes(config: str = "rngd", model: str | None = None,
                      root: Path | None = None) -> GraphShapes:
    """Every graph the model repository asks of an RNGD card under `config` (model_configs): for
    each model whose `device` is rngd, what its engines prepare (`prefill_shapes` of its chunk_size
    and max_len, `decode_shapes` of its num_slots and max_len; colocated both), max_len capped by
    the model's context as the engines cap it; compute dtype as the card loads it
    (`choose_compute_dtype` on rngd: bf16 unless a config forces another). The union, in one
    GraphShapes; models that disagree on dtypes are a ConfigError."""
    context = open_checkpoint(model).config().max_context
    chunks, past, decode, dtypes = set(), set(), set(), set()
    for path in model_configs(config, root).values():
        p = pbtxt_parameters(path)
        if p.get("device") != "rngd":
            continue
        max_len = min(int(p.get("max_len", context)), context)
        kv = p.get("kv_dtype", "bf16")
        dtypes.add((choose_compute_dtype(p.get("dtype") or AUTO, device="rngd").dtype, kv))
        parts = []
        if "chunk_size" in p:
            parts.append(prefill_shapes(int(p["chunk_size"]), max_len, kv))
        if "num_slots" in p:
            parts.append(decode_shapes(int(p["num_slots"]), max_len, kv))
        if not parts:
            raise ConfigError(f"{path}: device rngd, but neither chunk_size nor num_slots: which graphs?")
        for shapes in parts:
            chunks.update(shapes.prefill_chunks)
            past.update(shapes.prefill_past)
            decode.update(shapes.decode)
    if len(dtypes) > 1:
        raise ConfigError(f"the rngd models of config {config!r} differ in (compute, KV) dtypes "
                          f"{sorted(dtypes)}: give them one compute and one KV dtype")
    dtype, kv = dtypes.pop() if dtypes else ("bf16", "bf16")
    return GraphShapes(prefill_chunks=tuple(sorted(chunks)), decode=tuple(sorted(decode)), dtype=dtype,
                       kv_dtype=kv, prefill_past=tuple(sorted(past)))


def parse_rows(text: str) -> list[dict[str, Any]]:
    """The JSON lines of rngd.graphs' output (other lines, e.g. SDK log lines, are skipped)."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "name" in row and "ok" in row:
            rows.append(row)
    return rows


def _run_module(python: Path, args: list[str], timeout: float | None,
                env: Mapping[str, str] | None) -> subprocess.CompletedProcess[str]:
    """`python -m ARGS` in the RNGD environment, from the repository, killed with its caller."""

    return subprocess.run([str(python), "-m", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=repo_root(), env={**os.environ, **(env or {})}, preexec_fn=killed_with_parent)


def compile_check(shapes: GraphShapes | None = None, *, stage: str = "compile",
                  timeout: float | None = None, per_graph_timeout: float = 7200.0, no_cache: bool = False,
                  search: int | None = DEFAULT_SEARCH, model: str | None = None,
                  env: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """Export each graph `shapes` need (DEFAULT_SHAPES when None; a layer and a head graph per
    shape, rngd.graphs) and take it through the furiosa compiler in `.venv-rngd` up to `stage`:
    "import" (furiosa's decompositions and the DFG import, where unsupported ops are refused:
    seconds a graph), "lower" or "compile" (the whole compiler down to the binary: minutes a graph
    on a 2-core host, seconds from the furiosa cache), through `rngd.graphs.compile_graph`, the
    call serving compiles with, with the same tactic `search` (artifacts.DEFAULT_SEARCH unless told
    otherwise; None: furiosa's full search). One row per graph; a refused or failed graph is a row
    with ok False, not an exception; a missing environment is DeviceUnavailableError (naming
    `make rngd-env`), a run that printed no rows at all RngdPdError with its stderr."""
    python = require_rngd_python(env)
    shapes = DEFAULT_SHAPES if shapes is None else shapes
    args = [_GRAPHS, "--compile-only", *graph_args(shapes), "--stage", stage, "--json",
            "--timeout", str(per_graph_timeout), "--search", search_label(search)]
    args += (["--no-cache"] if no_cache else []) + (["--model", model] if model else [])
    proc = _run_module(python, args, timeout, env)
    rows = parse_rows(proc.stdout)
    if not rows and (shapes.prefill_chunks or shapes.decode):
        raise RngdPdError(f"rngd.graphs printed no results (exit status {proc.returncode}): "
                          f"{proc.stderr[-2000:].strip()}")
    return rows


def compile_artifacts(shapes: GraphShapes, out: str | Path, *, search: int | None = DEFAULT_SEARCH,
                      model: str | None = None, only: Sequence[str] = (), per_graph_timeout: float = 7200.0,
                      env: Mapping[str, str] | None = None) -> Iterator[dict[str, Any]]:
    """`rngd-pd compile`: every graph of `shapes` into the artifact directory `out`, one row per
    graph as it is done (source "artifacts": it was there already, nothing compiled; else
    compiled by `rngd.graphs.compile_graph` and saved); `only`: just these graph names. The
    `.venv-rngd` process draws its progress bar on this process's stderr."""
    python = require_rngd_python(env)
    cmd = [str(python), "-m", _GRAPHS, "--compile-only", *graph_args(shapes), "--stage", "compile", "--json",
           "--progress", "--timeout", str(per_graph_timeout), "--search", search_label(search),
           "--artifacts", str(Path(out).resolve())] + (["--model", model] if model else [])
    cmd += ["--only", ",".join(only)] if only else []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=repo_root(),
                            env={**os.environ, **(env or {})}, preexec_fn=killed_with_parent)
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            yield from parse_rows(line)
    finally:
        proc.stdout.close()
        if proc.wait() not in (0, 1):  # 1: some graph failed, and its row says so
            raise RngdPdError(f"rngd.graphs exited with status {proc.returncode} (its stderr is above)")


def smi_snapshot(env: Mapping[str, str] | None = None, timeout: float = 60.0) -> dict[str, Any]:
    """furiosa-smi's view of this host's RNGD cards (rngd_pd.devices.rngd.smi, run in `.venv-rngd`):
    driver, and per card power, temperature, memory; never raises: {"error": why} instead."""
    python = rngd_python(env)
    if python is None:
        return {"devices": [], "driver": None, "error": f"{rngd_env(env)} is missing; {MAKE_HINT}"}
    try:
        proc = _run_module(python, ["rngd_pd.devices.rngd.smi"], timeout, env)
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as exc:
        why = f"furiosa-smi did not answer: {type(exc).__name__}: {exc}"
        return {"devices": [], "driver": None, "error": why}


# ---------------------------------------------------------------- the card (hardware only)


def driver_missing() -> str | None:
    """Why the RNGD driver's HAL library cannot be loaded, or None (ctypes, no furiosa import)."""
    name = ctypes.util.find_library(DRIVER_LIB)
    try:
        ctypes.CDLL(name or f"lib{DRIVER_LIB}.so")
    except OSError as exc:
        return f"the RNGD driver library lib{DRIVER_LIB}.so cannot be loaded ({exc})"
    return None


def check_card(device: Device, env: Mapping[str, str] | None = None) -> None:
    """DeviceUnavailableError naming the first missing piece: environment, card node, driver."""
    require_rngd_python(env)
    found = cards(RNGD, env)
    if not found:
        raise unavailable(f"no FuriosaAI RNGD card is visible ({RNGD.card_glob})",
                          "RngdRuntime runs graphs only on a card: check the driver and the pod's "
                          "device mounts")
    if not 0 <= device.index < len(found):
        raise unavailable(f"RNGD card {device.index} is not among the {len(found)} visible", "fix device_ids")
    missing = driver_missing()
    if missing:
        raise unavailable(missing, "install the FuriosaAI driver (furiosa-driver-rngd) on the host")


class _Worker:
    """The `.venv-rngd` process that owns the card (rngd.graphs --serve). Not verified: no card."""

    def __init__(self, python: Path, device: Device, source: str, dtype: str,
                 options: CompileOptions) -> None:
        cmd = [str(python), "-m", _GRAPHS, "--serve", "--device-index", str(device.index),
               "--model", source, "--dtype", dtype, *options.args()]

        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sys.stderr,
                                     cwd=repo_root(), preexec_fn=killed_with_parent)
        self.lock = threading.Lock()

    def call(self, op: str, tensors: Iterable[Any] = (), **args: Any) -> tuple[dict[str, Any], list[Any]]:
        with self.lock:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(pack_message({"op": op, **args}, list(tensors)))
            self.proc.stdin.flush()
            header, out = read_message(self.proc.stdout)
        if header.get("error"):
            raise RngdPdError(f"RNGD worker, {op}: {header['error']}")
        return header, out


class RngdCache:
    """A KVCache resident on the card, held by the worker under an id (the KVCache methods the
    engines use: load, load_all, nbytes). Not verified: no card."""

    def __init__(self, worker: _Worker, config: Any, num_slots: int, max_len: int, dtype: Any) -> None:
        self.worker, self.config = worker, config
        self.num_slots, self.max_len, self.dtype = num_slots, max_len, dtype
        header, _ = worker.call("new_cache", slots=num_slots, max_len=max_len, kv_dtype=short_dtype(dtype))
        self.id = header["cache"]
        per = config.num_kv_heads * max_len * config.head_dim * 2 * config.num_layers * num_slots
        self.nbytes = per * lookup(dtype).itemsize

    def load(self, slot: int, layer: int, k: Any, v: Any, start: int = 0) -> None:
        self.worker.call("load", [k, v], cache=self.id, slot=slot, layer=layer, start=start)

    def read(self, slot: int, layer: int, start: int, end: int) -> tuple[Any, Any]:
        """One layer's K/V of `slot` at positions [start, end), copied to the host."""
        _, (k, v) = self.worker.call("read", cache=self.id, slot=slot, layer=layer, start=start, end=end)
        return k, v

    def load_all(self, slot: int, kv: KVList, start: int = 0) -> None:
        if len(kv) != self.config.num_layers:
            raise ConfigError(f"got K/V for {len(kv)} layers, the model has {self.config.num_layers}")
        self.worker.call("load", [t for pair in kv for t in pair], cache=self.id, slot=slot, layer=-1,
                         start=start)


class RngdRuntime:
    """One model on one RNGD card (the DeviceRuntime protocol); see the module docstring for what
    is verified. Graphs have static shapes: `prepare` compiles (or takes from the furiosa cache)
    each prefill chunk and decode (width, bucket) in the worker and loads them onto the card."""

    def __init__(self, device: Device, loaded: Any, env: Mapping[str, str] | None = None,
                 options: CompileOptions | None = None) -> None:
        """`options`: the compiler's tactic search and the artifact directory the worker loads its
        graphs from (a graph missing there is compiled, said in the log, and saved there)."""
        if device.kind != "rngd":
            raise unavailable(f"RngdRuntime cannot run on {device.kind!r}", "use device rngd")
        check_card(device, env)  # raises here, on every host without a card and its driver
        worker = _Worker(require_rngd_python(env), device, loaded.source,  # pragma: no cover - a card
                         short_dtype(loaded.model.dtype), options or CompileOptions())
        self._attach(device, loaded, worker)  # pragma: no cover

    @classmethod
    def over(cls, worker: Any, device: Device, loaded: Any) -> RngdRuntime:
        """A runtime over a worker already running: anything with `_Worker.call`'s signature (the
        tests drive an in-process `rngd.graphs.CardWorker` on CPU graphs this way)."""
        self = cls.__new__(cls)
        self._attach(device, loaded, worker)
        return self

    def _attach(self, device: Device, loaded: Any, worker: Any) -> None:
        self.device, self.loaded, self.worker = device, loaded, worker
        self.chunks: tuple[int, ...] = ()
        self.past: tuple[int, ...] = ()

    def prepare(self, shapes: GraphShapes) -> None:
        header, _ = self.worker.call("prepare", chunks=list(shapes.prefill_chunks),
                                     past=list(shapes.prefill_past), decode=[list(d) for d in shapes.decode],
                                     kv_dtype=short_dtype(shapes.kv_dtype))
        failed = [r for r in header.get("rows", []) if not r.get("ok")]
        if failed:
            r = failed[0]
            raise ConfigError(f"the furiosa compiler refused {r['name']} ({r['shape']}): "
                              f"{r.get('refused_ops') or ''} {r.get('error', '')[-800:]}")
        self.chunks = tuple(sorted(set(self.chunks) | set(shapes.prefill_chunks)))
        self.past = tuple(sorted(set(self.past) | set(shapes.prefill_past)))

    def dtype(self, name: Any) -> Any:
        return torch_dtype(name)

    def inference(self) -> contextlib.AbstractContextManager[Any]:
        import torch

        return torch.inference_mode()

    def tokens(self, ids: Sequence[int] | Any) -> Any:
        import torch

        return torch.as_tensor(np.asarray(ids, dtype=np.int64))

    def prefill(self, tokens: Any, past: KVList | None = None, on_layer: OnLayer | None = None,
                kv_dtype: Any = "bf16", all_logits: bool = False) -> tuple[Any, KVList]:
        """A chunk of up to the longest compiled length T after a past of up to the longest past
        bucket; shorter ones run padded in the smallest graph that holds them (the engine splits
        longer prompts into chunks). The compiled graphs end in the last token's logits only, so
        prompt logprobs (`all_logits`) are refused."""
        if all_logits:
            raise ConfigError("prompt logprobs need every position's logits; the RNGD prefill graphs "
                              "return the last one's: ask for them from a cpu or cuda prefill")
        t, p = int(tokens.shape[0]), int(past[0][0].shape[1]) if past else 0
        if not self.chunks or t > self.chunks[-1]:
            raise ConfigError(f"a chunk of {t} tokens is longer than the longest RNGD prefill graph "
                              f"(compiled: {list(self.chunks)}): prefill in chunks of at most that")
        if p and (not self.past or p > self.past[-1]):
            raise ConfigError(f"a past of {p} tokens is longer than the longest RNGD past bucket "
                              f"(compiled: {list(self.past)}): raise the prefill max_len")
        flat = [x for kv in past for x in kv] if past else []
        _, out = self.worker.call("prefill", [tokens, *flat], kv_dtype=short_dtype(kv_dtype))
        kv = [(out[1 + 2 * i], out[2 + 2 * i]) for i in range((len(out) - 1) // 2)]
        if on_layer is not None:
            for i, (k, v) in enumerate(kv):
                on_layer(i, k, v)
        return out[0].float(), kv

    def empty(self, shape: Sequence[int], dtype: Any) -> Any:
        import torch

        return torch.empty(tuple(shape), dtype=self.dtype(dtype))  # host staging (KV assembly)

    def new_cache(self, num_slots: int, max_len: int, kv_dtype: Any) -> Any:
        return RngdCache(self.worker, self.loaded.config, num_slots, max_len, self.dtype(kv_dtype))

    def step_buffers(self, rows: int) -> tuple[Any, Any]:
        import torch

        host = np.zeros((3, rows), dtype=np.int64)
        return host, torch.from_numpy(host)  # sent to the worker with each step (3 x rows int64)

    def decode_step(self, tokens: Any, positions: Any, cache: Any, slots: Any) -> Any:
        _, out = self.worker.call("decode", [tokens, positions, slots], cache=cache.id)
        return out[0].float()

    def decode_step_parts(self, tokens: Any, positions: Any, parts: Sequence[tuple[Any, Any]]) -> Any:
        return step_parts_in_turn(self, tokens, positions, parts)  # a graph per bucket shape

    def to_host(self, tensor: Any) -> Any:
        return tensor  # the worker's results arrive on the host already

    def to_device(self, tensor: Any) -> Any:
        return tensor  # uploaded by the worker call that uses it

    def compute_thread(self) -> None:
        """Nothing is kept per thread."""

    def memory(self) -> MemoryInfo:
        header, _ = self.worker.call("memory")
        return MemoryInfo(int(header["total"]), int(header["free"]), header.get("detail", {}))
