"""The RNGD graphs: one decoder layer and the LM head at fixed shapes, compiled by furiosa-torch.

Runs INSIDE `.venv-rngd` (`make rngd-env`: furiosa-torch 2026.4.0 with its torch 2.10 and numpy 2),
never in the serving environment; `rngd_pd.devices.rngd.runtime.compile_check` starts it as a subprocess:

    .venv-rngd/bin/python -m rngd_pd.devices.rngd.graphs --compile-only --chunks 128,512 \\
        --decode 1x512,8x2048 --json

prints one JSON line per graph: {"graph", "part", "name", "shape", "dtype", "kv_dtype", "sdk", "ok",
"seconds", "stage", "error", "refused_ops", ...}. Each export + compile runs in a child process of
its own (a Rust panic in the SDK aborts the interpreter; the parent reports it as a failed graph and
goes on).

A model is never one graph: each shape compiles a **layer graph** (one decoder layer, its weights
graph inputs) that runs once per layer with that layer's weights, and a **head graph** (final norm,
LM head, its two weights inputs too). The compiler so holds one layer whatever the depth: a whole
30-layer graph's lowering passed 16 GB here and did not finish. Static shapes, KV as explicit
inputs and outputs, no module state; the embedding lookup stays on the host (`embed_tokens`):

* `prefill_layer_t<T>`: x [T, hidden], then the layer's 6 weights -> (x, K, V), K/V [kv_heads, T,
  head_dim] in the KV dtype: `Llama.prefill_layer` of a first chunk, the very code `Llama.prefill`
  runs. `prefill_head_t<T>`: x [T, hidden], last int64 [1], norm, lm_head -> fp32 logits [vocab] of
  row `last` (a prompt of n < T tokens runs padded; its rows never see the padding).
  `prefill_layer_t<T>_l<L>`: a chunk after earlier ones: x, the chunk's RoPE rows cos/sin [T,
  head_dim] and the keys' mask [L + T] (-inf on the past's padding: `past_mask`) from the host, the
  past K/V [kv_heads, L, head_dim] padded to the bucket L (`runtime.past_buckets`), the weights ->
  (x, K, V).
* `decode_layer_b<B>_l<L>`: x [B, hidden], positions int64 [B], slots int64 [B], K, V [B, kv_heads,
  L, head_dim] (a static cache of B slots of L positions), the layer's weights -> (x, K, V updated).
  The blocks of `Llama.decode_step` (projections, RoPE, attention, SwiGLU) without its host-side
  work (`.tolist()`, packed oneDNN weights, zero-padded rows), attending over the whole bucket under
  the positions' mask by `_attend`'s matmuls (the eager step's SDPA is not an op this compiler
  lowers). `decode_head_b<B>`: x [B, hidden], norm, lm_head -> fp32 logits [B, vocab].

Each graph goes through furiosa's own preprocessing (`preprocess_exported_program`: its 802
decomposition rules; torch's `run_decompositions()` would give aten.addmm, which the DFG importer
refuses), then `--stage import` (the DFG import, where unsupported ops are refused), `lower` or
`compile` (all 12 compiler stages, down to the binary). The compiler needs an aarch64 cross
compiler (`aarch64-linux-gnu-gcc` and its libc headers) for its last stages. A compile child past
`--timeout` or `--max-rss-gb` is killed and reported with the compiler stage it reached.
docs/devices-rngd.md has what compiled here and how long it took.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from tqdm import tqdm

from rngd_pd.config.dtypes import COMPUTE_DTYPES, KV_DTYPES, short_dtype, torch_dtype
from rngd_pd.devices.rngd.artifacts import (
    DEFAULT_SEARCH,
    ArtifactKey,
    ArtifactStore,
    CompileOptions,
    digest_text,
    parse_search,
    search_label,
)
from rngd_pd.devices.rngd.messages import pack_message, read_message
from rngd_pd.devices.rngd.smi import memory
from rngd_pd.devices.runtime import DEFAULT_SHAPES
from rngd_pd.errors import RngdPdError
from rngd_pd.host.children import killed_with_parent
from rngd_pd.model import llama as L
from rngd_pd.model import load_model
from rngd_pd.model import rope as model_rope
from rngd_pd.model.checkpoint import open_checkpoint

PARTS = ("layer", "head")


@dataclass(frozen=True)
class GraphSpec:
    """One compiled graph: `part` "layer" (one decoder layer with its weights as inputs, called once
    per layer) or "head" (final norm and LM head) of the prefill of `t` tokens (after a past bucket
    of `l` positions when l > 0) or of the decode step of `b` rows over a bucket of `l` positions (a
    head depends on `t` or `b` only)."""

    kind: str
    part: str = "layer"
    t: int = 0
    b: int = 0
    l: int = 0  # noqa: E741 - the bucket length, as in the docs

    @property
    def shape(self) -> str:
        if self.kind == "prefill":
            return f"T={self.t},L={self.l}" if self.l else f"T={self.t}"
        return f"B={self.b}" if self.part == "head" else f"B={self.b},L={self.l}"

    @property
    def name(self) -> str:
        if self.kind == "prefill":
            return f"prefill_{self.part}_t{self.t}" + (f"_l{self.l}" if self.l else "")
        return f"decode_head_b{self.b}" if self.part == "head" else f"decode_layer_b{self.b}_l{self.l}"


def specs(chunks: tuple[int, ...] = DEFAULT_SHAPES.prefill_chunks,
          decode: tuple[tuple[int, int], ...] = DEFAULT_SHAPES.decode,
          past: tuple[int, ...] = ()) -> list[GraphSpec]:
    """Every graph these shapes need: per prefill chunk a layer, a head and a layer after each past
    bucket; a layer per decode (width, bucket) and a head per decode width."""
    out = [GraphSpec("prefill", part, t=t) for t in chunks for part in PARTS]
    out += [GraphSpec("prefill", "layer", t=t, l=n) for t in chunks for n in past]
    out += [GraphSpec("decode", "layer", b=b, l=n) for b, n in decode]
    out += [GraphSpec("decode", "head", b=b) for b in dict.fromkeys(b for b, _ in decode)]
    return out


def parse_decode(text: str) -> tuple[tuple[int, int], ...]:
    """"1x512,8x2048" -> ((1, 512), (8, 2048))."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\d+)[xX](\d+)", part)
        if not m:
            raise ValueError(f"decode shape {part!r} is not BxL (e.g. 8x2048)")
        out.append((int(m.group(1)), int(m.group(2))))
    return tuple(out)


def parse_chunks(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(",") if p.strip())


# ---------------------------------------------------------------- the export wrappers (torch only)


HEAD_WEIGHTS = ("norm", "lm_head")  # the head graph's weights, in its input order


def layer_weights(model: Any) -> list[tuple[Any, ...]]:
    """Each decoder layer's weights in the order a layer graph takes them (`Block`'s parameters)."""
    return [tuple(p for _, p in layer.named_parameters()) for layer in model.layers]


def head_weights(model: Any) -> tuple[Any, ...]:
    """The final norm and LM head weights, in the order a head graph takes them."""
    return tuple(getattr(model, n) for n in HEAD_WEIGHTS)


def with_weights(target: Any, names: Any, weights: tuple[Any, ...], fn: Any, *args: Any) -> Any:
    """fn(target, *args) with target's named weights swapped for `weights` (graph inputs), by
    `torch.func.functional_call`: one traced graph serves every layer's weights."""
    import torch
    from torch import nn

    class Apply(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.target = target

        def forward(self, *a: Any) -> Any:
            return fn(self.target, *a)

    params = {f"target.{n}": w for n, w in zip(names, weights, strict=True)}
    return torch.func.functional_call(Apply(), params, args)


def build_wrapper(model: Any, spec: GraphSpec, kv_dtype: Any) -> tuple[Any, tuple[Any, ...]]:
    """(nn.Module, example inputs) of one graph; `model` is a `rngd_pd.model.llama.Llama`.

    Every graph takes its weights as inputs: a layer graph is one decoder layer, compiled once per
    shape and called for each of the model's layers with that layer's weights (`prefill_chain`,
    `decode_chain`), so the compiler never holds the whole model (a 30-layer graph's lowering
    passed 16 GB here). The graphs take the tokens' embedding rows (`model.embed_tokens`, looked up
    on the host): furiosa's lowering leaves a gather of 64 or more rows un-lowered
    (docs/devices-rngd.md)."""
    import torch
    from torch import nn

    c = model.config
    names = [n for n, _ in model.layers[0].named_parameters()]
    layer0 = model.layers[0]

    def logits(x: torch.Tensor, w: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return with_weights(model, HEAD_WEIGHTS, w, lambda m, x: m._logits(x), x)

    class PrefillLayer(nn.Module):
        """`Llama.prefill_layer` of a first chunk of T tokens: (x, *weights) -> (x, K, V)."""

        def __init__(self, t: int) -> None:
            super().__init__()
            cos, sin = model._rope(*model.rope.span(0, t))
            self.register_buffer("cos", cos.clone(), persistent=False)  # [T, hd], compute dtype
            self.register_buffer("sin", sin.clone(), persistent=False)
            self.t = t

        def forward(self, x: torch.Tensor, *w: torch.Tensor) -> tuple[torch.Tensor, ...]:
            blocks = L._causal_blocks(0, self.t)
            return with_weights(layer0, names, w, lambda layer, x: model.prefill_layer(
                layer, x, self.cos, self.sin, blocks, None, kv_dtype), x)

    class PrefillPastLayer(nn.Module):
        """`Llama.prefill_layer` of a chunk of T tokens after a past of up to L: (x, cos, sin, mask,
        past K, past V, *weights) -> (x, K, V). The past is the cache of the earlier chunks padded
        to L (K/V [kv_heads, L, head_dim]); from the host come the chunk's RoPE rows cos/sin [T, hd]
        (a gather of T table rows is what furiosa cannot lower) and `mask` fp32 [L + T], added to
        every query row: -inf on the past's padding, else 0 (`past_mask`; a mask computed in the
        graph from the past's length was refused at the end of lowering, like the big gathers)."""

        def __init__(self, t: int, n: int) -> None:
            super().__init__()
            self.t, self.n = t, n

        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                    pk: torch.Tensor, pv: torch.Tensor, *w: torch.Tensor) -> tuple[torch.Tensor, ...]:
            blocks = [(s, e, bias + mask[: bias.shape[1]]) for s, e, bias in L._causal_blocks(self.n, self.t)]
            return with_weights(layer0, names, w, lambda layer, x: model.prefill_layer(
                layer, x, cos, sin, blocks, (pk, pv), kv_dtype), x)

    class PrefillHead(nn.Module):
        """Row `last` of x [T, D] (the prompt's last token; rows past it are padding) -> fp32 logits."""

        def __init__(self, t: int) -> None:
            super().__init__()
            self.register_buffer("rows", torch.arange(t), persistent=False)

        def forward(self, x: torch.Tensor, last: torch.Tensor, *w: torch.Tensor) -> torch.Tensor:
            pick = (last[:, None] == self.rows[None, :]).to(x.dtype)  # [1, T] one-hot
            return logits(_gather(pick, x), w)[0]

    class DecodeLayer(nn.Module):
        """One decoder layer of a decode step of B rows against a static cache of B slots x L
        positions: (x, positions, slots, K, V, *weights) -> (x, K, V with the step's rows written)."""

        def __init__(self, b: int, n: int) -> None:
            super().__init__()
            self.b, self.n = b, n
            cos, sin = model.rope.rows(n)
            self.register_buffer("cos", cos[:n].clone(), persistent=False)  # fp32 [L, hd]
            self.register_buffer("sin", sin[:n].clone(), persistent=False)
            self.register_buffer("keys", torch.arange(n), persistent=False)
            self.register_buffer("heads", torch.arange(c.num_kv_heads), persistent=False)
            self.register_buffer("slot_ids", torch.arange(b), persistent=False)  # the cache's B slots

        def forward(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, ck: torch.Tensor,
                    cv: torch.Tensor, *w: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return with_weights(layer0, names, w, self.body, x, positions, slots, ck, cv)

        def body(self, layer: Any, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 ck: torch.Tensor, cv: torch.Tensor) -> tuple[torch.Tensor, ...]:
            b, n = self.b, self.n
            # keys row b cannot see, [B, L]; decode_step's ~(keys <= position): the compiler refuses
            # aten.bitwise_not past its DFG stage ("Lowering Deadline Violation")
            hidden = self.keys[None, :] > positions[:, None]
            bias = torch.zeros(b, 1, 1, n, device=x.device).masked_fill(
                hidden.view(b, 1, 1, n), float("-inf"))
            cos = self.cos[positions].to(model.dtype)[:, None]  # [B, 1, hd]
            sin = self.sin[positions].to(model.dtype)[:, None]
            at = (slots[:, None], self.heads[None, :], positions[:, None])  # [B, KVH] index triples
            pick = (slots[:, None] == self.slot_ids[None, :]).to(ck.dtype)  # [B, S] one-hot rows
            qk, v = layer.qkv_heads(x)
            qk = L.apply_rope(qk, cos, sin)
            q, k = qk[:, : c.num_heads], qk[:, c.num_heads:]
            ck = torch.index_put(ck, at, k.to(ck.dtype))  # ck[slots, :, positions] = k
            cv = torch.index_put(cv, at, v.to(cv.dtype))
            kk = _gather(pick, ck).to(model.dtype)  # [B, KVH, L, hd]: ck[slots]
            vv = _gather(pick, cv).to(model.dtype)
            qg = q.reshape(b, c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim)
            o = L._attend(qg, kk, vv, bias, c.head_dim**-0.5)
            return layer.finish(x, o.reshape(b, -1)), ck, cv

    class DecodeHead(nn.Module):
        """x [B, D] after the last layer -> fp32 logits [B, vocab]."""

        def forward(self, x: torch.Tensor, *w: torch.Tensor) -> torch.Tensor:
            return logits(x, w)

    if spec.kind == "prefill":
        x = model.embed_tokens(torch.arange(spec.t, dtype=torch.long) % c.vocab_size)
        if spec.part == "head":
            return PrefillHead(spec.t), (x, torch.tensor([spec.t - 1]), *head_weights(model))
        if spec.l:
            cos, sin = model._rope(*model.rope.span(spec.l, spec.t))
            pk, pv = (torch.zeros(c.num_kv_heads, spec.l, c.head_dim, dtype=kv_dtype) for _ in range(2))
            return PrefillPastLayer(spec.t, spec.l), (x, cos, sin, past_mask(spec.l, spec.l, spec.t), pk, pv,
                                                       *layer0.parameters())
        return PrefillLayer(spec.t), (x, *layer0.parameters())
    b, n = spec.b, spec.l
    x = model.embed_tokens(torch.ones(b, dtype=torch.long))
    if spec.part == "head":
        return DecodeHead(), (x, *head_weights(model))
    ck, cv = (torch.zeros(b, c.num_kv_heads, n, c.head_dim, dtype=kv_dtype) for _ in range(2))
    positions = torch.arange(b, dtype=torch.long) % n
    return DecodeLayer(b, n), (x, positions, torch.arange(b), ck, cv, *layer0.parameters())


def past_mask(p: int, bucket: int, t: int) -> Any:
    """The past layer graph's `mask` [bucket + t]: -inf on the positions of a past of p tokens padded
    to the bucket, 0 on the real past and the chunk's own keys (causality is the graph's)."""
    import torch

    mask = torch.zeros(bucket + t)
    mask[p:bucket] = float("-inf")
    return mask


def prefill_chain(layer: Any, head: Any, x: Any, last: Any, weights: list[tuple[Any, ...]],
                  head_w: tuple[Any, ...], past: tuple[Any, Any, Any, list[Any]] | None = None
                  ) -> tuple[Any, list[Any]]:
    """A prefill through a layer graph and a head graph (compiled or not): (logits, [K_0, V_0, ...]).
    `past`: (cos, sin, mask, [K_0, V_0, ...] of the earlier chunks, padded to the graph's bucket)."""
    kv = []
    for i, w in enumerate(weights):
        extra = (*past[:3], past[3][2 * i], past[3][2 * i + 1]) if past else ()
        x, k, v = layer(x, *extra, *w)
        kv += [k, v]
    return head(x, last, *head_w), kv


def decode_chain(layer: Any, head: Any, x: Any, positions: Any, slots: Any, kv: list[Any],
                 weights: list[tuple[Any, ...]], head_w: tuple[Any, ...]) -> tuple[Any, list[Any]]:
    """A decode step through a layer graph and a head graph: (logits [B, vocab], the updated cache)."""
    out = []
    for i, w in enumerate(weights):
        x, ck, cv = layer(x, positions, slots, kv[2 * i], kv[2 * i + 1], *w)
        out += [ck, cv]
    return head(x, *head_w), out


def _gather(pick: Any, cache: Any) -> Any:
    """cache[i] for the one-hot rows of pick [B, S] as a matmul, cache [S, ...] -> [B, ...]: exact
    (each output is 1 x one value plus zeros) where the furiosa compiler has no tactic for
    index_select over a graph input ("GatherKernel ... all tactics failed to compile", decode 1x512)."""
    s = cache.shape[0]
    return (pick @ cache.reshape(s, -1)).reshape(pick.shape[0], *cache.shape[1:])


def export(model: Any, spec: GraphSpec, kv_dtype: Any) -> Any:
    """torch.export (strict=False, as furiosa-torch's own `CompileModule.from_module` does)."""
    import torch

    module, inputs = build_wrapper(model, spec, kv_dtype)
    return torch.export.export(module.eval(), inputs, strict=False)


# ---------------------------------------------------------------- the compiler (furiosa-torch only)

TOOLCHAIN = "aarch64-linux-gnu-gcc"  # the compiler builds the PEs' C code with it (found by strace)
TOOLCHAIN_PACKAGES = ("gcc-aarch64-linux-gnu", "libc6-dev-arm64-cross")  # Debian / Ubuntu
TOOLCHAIN_INSTALL = f"apt-get update && apt-get install -y {' '.join(TOOLCHAIN_PACKAGES)}"
TOOLCHAIN_HINT = ("install an aarch64 cross compiler with its libc headers, e.g. on Debian/Ubuntu "
                  f"`{TOOLCHAIN_INSTALL}` (as root)")


def toolchain_missing(path: str | None = None) -> str | None:
    """Why the furiosa compiler cannot finish here (it runs `aarch64-linux-gnu-gcc -lpe ...` on C
    code that includes <assert.h>), or None. `path`: the PATH to look in (default: $PATH)."""
    cc = shutil.which(TOOLCHAIN, path=path)
    if cc is None:
        return f"{TOOLCHAIN} is not on PATH (the furiosa compiler fails with 'No such file or directory'); " \
               + TOOLCHAIN_HINT
    probe = subprocess.run([cc, "-xc", "-E", "-o", os.devnull, "-"], input=b"#include <assert.h>\n",
                           capture_output=True, timeout=60)
    if probe.returncode:
        err = probe.stderr.decode()[-200:].strip()
        return f"{TOOLCHAIN} cannot find the aarch64 libc headers ({err}); " \
               + TOOLCHAIN_HINT
    return None


def ensure_toolchain(install: bool = True, env: dict[str, str] | None = None,
                     out: Any = None) -> int:
    """`make test-rngd`'s toolchain step: 0 when `aarch64-linux-gnu-gcc` and its libc headers work (after
    installing them with apt-get when `install`, missing and root), else 1 with the exact command
    to run. Never a silent skip: the message says what is missing and how to get it."""
    env = dict(os.environ if env is None else env)
    out = out or sys.stdout
    path = env.get("PATH", os.defpath)
    missing = toolchain_missing(path)
    if missing is None:
        print(f"rngd toolchain: {shutil.which(TOOLCHAIN, path=path)} (with the aarch64 libc headers) ok",
              file=out, flush=True)
        return 0
    apt = shutil.which("apt-get", path=path)
    if install and os.geteuid() == 0 and apt:
        print(f"rngd toolchain: {missing}\nrngd toolchain: installing {' '.join(TOOLCHAIN_PACKAGES)}",
              file=out, flush=True)
        run_env = {**env, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in ([apt, "update"], [apt, "install", "-y", "--no-install-recommends", *TOOLCHAIN_PACKAGES]):
            if subprocess.run(cmd, env=run_env).returncode:
                print(f"rngd toolchain: FAILED: `{' '.join(cmd)}`", file=out, flush=True)
                return 1
        missing = toolchain_missing(path)
        if missing is None:
            print(f"rngd toolchain: installed {shutil.which(TOOLCHAIN, path=path)}", file=out, flush=True)
            return 0
    why = ("not root" if os.geteuid() != 0 else "no apt-get on PATH" if not apt else "still missing")
    print(f"rngd toolchain: FAILED ({why}): {missing}\n"
          f"rngd toolchain: run as root: {TOOLCHAIN_INSTALL}\n"
          f"rngd toolchain: (or: sudo sh -c '{TOOLCHAIN_INSTALL}'), then `make test-rngd` again",
          file=out, flush=True)
    return 1


def sdk_versions() -> dict[str, str]:
    out = {}
    for dist in ("furiosa-torch", "torch"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    try:
        from furiosa.torch import compiler

        out["compiler"] = str(compiler.version())
    except Exception as exc:  # reported, not fatal: the row says the SDK is broken
        out["compiler"] = f"unavailable: {exc}"
    return out


_NODE = re.compile(r'name: "([^"]+)", op: CallFunction, target: TorchOp\("([^"]+)"')
_DEADLINE = re.compile(r"Aten\((\w+)\) is allowed up to")  # "Lowering Deadline Violation"


def refused_ops(text: str) -> list[str]:
    """The aten ops a furiosa compile error names as not importable
    (`Not importable, Node { ... TorchOp("aten::addmm", ...`)."""
    found = [op for _, op in _NODE.findall(text)] + [f"aten::{op}" for op in _DEADLINE.findall(text)]
    return sorted(set(found))


def unsupported_ops(ep: Any) -> list[str]:
    """aten call_function targets of a (preprocessed) graph that
    `furiosa.torch.compiler.is_supported_aten` rejects under both their overload name
    ("aten::add.Tensor") and their plain name ("aten::add")."""
    from furiosa.torch import compiler

    names = set()
    for node in ep.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op == "call_function" and schema is not None and schema.name.startswith("aten::"):
            names.add((schema.name, f"{schema.name}.{schema.overload_name}" if schema.overload_name else ""))
    ok = compiler.is_supported_aten
    return sorted(full or plain for plain, full in names if not ok(plain) and not (full and ok(full)))


def _short(text: str, limit: int = 4000) -> str:
    """The end of an SDK error (the cause is at the end; the graph dump before it is long)."""
    tail = text[text.find("compile error:"):] if "compile error:" in text else text
    return tail if len(tail) <= limit else "..." + tail[-limit:]


STAGES = ("import", "lower", "compile")  # how far compile_graph goes: import_dfg, lower, compile


def compiler_config(search: int | None = DEFAULT_SEARCH, tactic_hint: str | None = None) -> Any:
    """THE furiosa CompilerConfig of every RNGD compile: progress as JSON lines (on stderr) and the
    tactic search bounded to `search` unique shapes (None: furiosa's full search; artifacts.py)."""
    from furiosa.torch import config
    from furiosa.torch._C.config.compiler import ProgressMode

    kw: dict[str, Any] = {"progress_mode": ProgressMode.Json}
    if tactic_hint:
        kw["tactic_hint"] = getattr(config.TacticHintConfig, tactic_hint)
    if search is not None:
        kw["max_num_unique_shapes"] = search
    return config.CompilerConfig(**kw)


@dataclass
class CompiledGraph:
    """One graph through the furiosa compiler: the preprocessed program (its weights' and buffers'
    flattening, which the card module needs) and, at stage compile, the Runnable (the binary)."""

    spec: GraphSpec
    program: Any  # the ExportedProgram after furiosa's preprocessing
    reconstructor: Any  # furiosa's ExportedProgramOutputReconstructor for it
    runnable: Any = None  # furiosa.torch._C.ir.Runnable (stage compile)
    source: str = "compiled"  # or "artifacts": read from an ArtifactStore, not compiled
    info: dict[str, Any] = field(default_factory=dict)  # nodes, unsupported_aten, cache, artifact

    def module(self) -> Any:
        """The callable furiosa module of the binary (furiosa's CompileModule: what
        `CompileModule.from_exported` builds, over this Runnable); `.to(furiosa:N)` loads it."""
        from furiosa.torch import CompileModule
        from furiosa.torch._module.runnable import Runnable
        from furiosa.torch.export import ExportedProgramWeight

        return CompileModule(Runnable(self.runnable), ExportedProgramWeight(self.program), self.reconstructor)


def compile_graph(ep: Any, spec: GraphSpec, search: int | None = DEFAULT_SEARCH, *, stage: str = "compile",
                  tactic_hint: str | None = None, cache_root: str | None = None,
                  secs: dict[str, float] | None = None) -> CompiledGraph:
    """THE one call into the furiosa compiler: serving's card worker (`build_graph`, `card_builder`),
    `--compile-only` and CI (`compile_one`) and `rngd-pd compile` (`compile_one` under `--artifacts`)
    all compile here, with one CompilerConfig (`compiler_config(search)`). furiosa's own
    preprocessing first (what `CompileModule.from_exported` runs; torch's `run_decompositions()`
    would give aten.addmm, which the DFG importer refuses), then the DFG import (where ops are
    refused), then `stage` lower or compile. `cache_root`: the furiosa compile cache directory
    (None: its default, ~/.cache/furiosa/compiler). Raises what the SDK raises."""
    import furiosa.torch  # noqa: F401 - registers the device and its ops
    from furiosa.torch import compiler, config
    from furiosa.torch.export.exported_program import preprocess_exported_program

    secs = {} if secs is None else secs
    t = time.perf_counter()
    program, reconstructor = preprocess_exported_program(ep)
    secs["preprocess"] = round(time.perf_counter() - t, 2)
    out = CompiledGraph(spec, program, reconstructor)
    out.info["nodes"] = sum(1 for n in program.graph.nodes if n.op == "call_function")
    out.info["unsupported_aten"] = unsupported_ops(program)
    t = time.perf_counter()
    compiler.import_dfg(program)
    secs["import"] = round(time.perf_counter() - t, 2)
    if stage == "import":
        return out
    root = cache_root or config.CacheConfig.default_cache_dir()
    before = set(os.listdir(root)) if root and os.path.isdir(root) else set()
    t = time.perf_counter()
    cc = compiler_config(search, tactic_hint)
    with config.cache_context(root_dir=root):
        if stage == "lower":
            compiler.lower(program, cc, task_name=spec.name)
        else:
            out.runnable = compiler.compile(program, cc, task_name=spec.name)
    secs[stage] = round(time.perf_counter() - t, 2)
    if root:
        out.info["cache"] = "miss" if set(os.listdir(root)) - before else "hit"
    return out


def graph_code_digest() -> str:
    """sha256 of the source that decides what a graph computes (the wrappers here, the model's
    layer code and RoPE): part of an artifact's key, so a binary of older code is never loaded."""
    return digest_text(*(inspect.getsource(o) for o in (GraphSpec, build_wrapper, with_weights, past_mask,
                                                         _gather, export, L, model_rope)))


def artifact_key(config: Any, spec: GraphSpec, dtype: str, kv_dtype: str, search: int | None) -> ArtifactKey:
    """The key of `spec`'s binary for a model of `config` (a ModelConfig): artifacts.ArtifactKey."""
    from furiosa.torch import compiler

    return ArtifactKey(spec.name, spec.shape, short_dtype(dtype), short_dtype(kv_dtype), search_label(search),
                       str(compiler.version()), digest_text(config.to_json()), graph_code_digest())


def build_graph(model: Any, spec: GraphSpec, kv_dtype: Any, search: int | None = DEFAULT_SEARCH,
                store: ArtifactStore | None = None, *, cache_root: str | None = None,
                tactic_hint: str | None = None, secs: dict[str, float] | None = None,
                log: Any = None) -> CompiledGraph:
    """`spec`'s graph of `model` ready for the card: export, then the binary from `store` when it
    holds this graph's key (no compile), else `compile_graph` (said through `log`: a card host's
    load that compiles says so), saved into `store`. What the card worker
    runs at load and `rngd-pd compile` runs ahead of time."""
    secs = {} if secs is None else secs
    t = time.perf_counter()
    ep = export(model, spec, kv_dtype)
    secs["export"] = round(time.perf_counter() - t, 2)
    key = artifact_key(model.config, spec, model.dtype, kv_dtype, search) if store is not None else None
    if store is not None and key is not None and store.find(key) is not None:
        from furiosa.torch._C import ir
        from furiosa.torch.export.exported_program import preprocess_exported_program

        data, _ = store.read(key)
        program, reconstructor = preprocess_exported_program(ep)
        out = CompiledGraph(spec, program, reconstructor, ir.Runnable.deserialize(data), "artifacts")
        out.info["artifact"] = str(store.root / f"{key.stem}.runnable")
        return out
    if log is not None:
        where = f"is not in the artifacts {store.root}" if store is not None else \
            "has no artifact directory (rngd_artifacts; `rngd-pd compile` makes one)"
        log(f"{spec.name} ({spec.shape}) {where}: compiling it (search {search_label(search)})")
    out = compile_graph(ep, spec, search, tactic_hint=tactic_hint, cache_root=cache_root, secs=secs)
    if store is not None and key is not None:
        path = store.save(key, out.runnable.serialize(), {"seconds": dict(secs), "sdk": sdk_versions()})
        out.info["artifact"] = str(path)
        if log is not None:
            log(f"{spec.name}: compiled in {secs.get('compile', 0):.0f} s, saved as {path}")
    return out


def card_builder(model: Any, device: Any, options: CompileOptions, log: Any = None) -> Any:
    """The CardWorker's `build(spec, kv_dtype)` on a card: `build_graph` with the options' search
    and artifact directory, the binary loaded onto `device` (furiosa's `.to(furiosa:N)`)."""
    store = ArtifactStore(options.artifacts) if options.artifacts else None

    def build(spec: GraphSpec, kv_dtype: Any) -> Any:
        return build_graph(model, spec, kv_dtype, options.search, store, log=log).module().to(device)

    return build


def _row_base(spec: GraphSpec, args: argparse.Namespace) -> dict[str, Any]:
    """The fields every result row of one graph starts with (a failed one keeps them)."""
    return {"graph": spec.kind, "part": spec.part, "name": spec.name, "shape": spec.shape,
            "dtype": args.dtype, "kv_dtype": args.kv_dtype, "target": args.stage, "ok": False,
            "refused_ops": [],  # the search bound acts after the import, where the tactics are searched
            "search": search_label(args.search) if args.stage != "import" else None}


def compile_one(spec: GraphSpec, args: argparse.Namespace) -> dict[str, Any]:
    """One graph in THIS process up to args.stage, through `compile_graph` (at stage compile by
    way of `build_graph`, into the artifact directory `--artifacts` when given); a dict row, never
    raises (a Rust panic is caught as PanicException where PyO3 raises one)."""
    row = {**_row_base(spec, args), "stage": "setup", "error": "", "seconds": {}}
    secs = row["seconds"]
    t0 = time.perf_counter()
    fresh = None
    try:
        row["sdk"] = sdk_versions()
        missing = toolchain_missing() if args.stage == "compile" else None
        if missing:
            row.update(stage="toolchain", error=missing)
            return row
        row["stage"] = "load"
        loaded = load_model(args.model, dtype=torch_dtype(args.dtype), progress=False)
        secs["load"] = round(time.perf_counter() - t0, 2)
        # --no-cache: an empty cache of its own, removed after; the compiler still reads and writes
        # its default cache with root_dir=None (seen: a graph compiled before came back in 17 s)
        fresh = tempfile.mkdtemp(prefix="rngd-compile-") if args.no_cache else None
        row["stage"] = args.stage
        kv = torch_dtype(args.kv_dtype)
        if args.stage == "compile":
            store = ArtifactStore(args.artifacts) if args.artifacts else None
            out = build_graph(loaded.model, spec, kv, args.search, store, cache_root=fresh,
                              tactic_hint=args.tactic_hint, secs=secs)
            row["binary_bytes"] = int(out.runnable.binary.numel() * out.runnable.binary.element_size())
            row["source"] = out.source
        else:
            t = time.perf_counter()
            ep = export(loaded.model, spec, kv)
            secs["export"] = round(time.perf_counter() - t, 2)
            out = compile_graph(ep, spec, args.search, stage=args.stage, tactic_hint=args.tactic_hint,
                                cache_root=fresh, secs=secs)
        row.update(out.info)
        row.update(ok=True, stage="done")
    except BaseException as exc:  # PyO3's PanicException is a BaseException; it is the row's error
        text = f"{type(exc).__name__}: {exc}"
        if row["stage"] == args.stage:  # the step compile_graph had not finished
            row["stage"] = next(s for s in ("export", "preprocess", "import", args.stage) if s not in secs)
        row["error"] = _short(text)
        row["refused_ops"] = refused_ops(text)
        if not isinstance(exc, Exception) and type(exc).__name__ != "PanicException":
            raise
    finally:
        if fresh:
            shutil.rmtree(fresh, ignore_errors=True)
        secs["total"] = round(time.perf_counter() - t0, 2)
    return row


def _child_args(args: argparse.Namespace) -> list[str]:
    out = ["--dtype", args.dtype, "--kv-dtype", args.kv_dtype, "--stage", args.stage, "--json",
           "--search", search_label(args.search)]
    if args.no_cache:
        out.append("--no-cache")
    if args.tactic_hint:
        out += ["--tactic-hint", args.tactic_hint]
    if args.model:
        out += ["--model", args.model]
    if args.artifacts:
        out += ["--artifacts", args.artifacts]
    out += ["--max-rss-gb", str(args.max_rss_gb)]
    return out


def last_progress(text: str) -> str:
    """The last compiler progress line ({"name": "Compiling from X to Y", "current_stage": i, ...})."""
    for line in reversed(text.splitlines()):
        if line.startswith('{"name":"Compiling'):
            with contextlib.suppress(ValueError):
                p = json.loads(line)
                return f"{p['name']} ({p['current_stage']}/{p['stages']})"
    return ""


def _rss_gb(pid: int) -> float:
    with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    return 0.0


def _watch(proc: Any, timeout: float, max_rss_gb: float) -> tuple[int | None, str]:
    """Wait for a compile child; kill it past `timeout` seconds or `max_rss_gb` of resident memory
    (a 30-layer decode graph grew past 16 GB in the compiler's lowering stage here)."""
    start = time.monotonic()
    while proc.poll() is None:
        rss = _rss_gb(proc.pid)
        why = (f"no result within {timeout:.0f} s (--timeout)" if time.monotonic() - start > timeout else
               f"{rss:.1f} GB resident, over --max-rss-gb {max_rss_gb:g}" if max_rss_gb and rss > max_rss_gb
               else "")
        if why:
            proc.kill()
            proc.wait()
            return None, why if "resident" in why else "timeout: " + why
        time.sleep(1.0)
    return proc.returncode, ""


def run_child(spec: GraphSpec, args: argparse.Namespace) -> dict[str, Any]:
    """compile_one in a child process (a Rust panic or abort kills only the child); a child that
    runs past args.timeout is killed and reported with the compiler stage it had reached."""
    cmd = [sys.executable, "-m", "rngd_pd.devices.rngd.graphs", "--one", spec.name, *_child_args(args)]
    t0 = time.perf_counter()
    base = _row_base(spec, args)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, preexec_fn=killed_with_parent)
        code, killed = _watch(proc, args.timeout, args.max_rss_gb)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    secs = {"total": round(time.perf_counter() - t0, 2)}
    for line in reversed(stdout.splitlines()):
        if line.startswith("{") and '"ok"' in line:
            with contextlib.suppress(json.JSONDecodeError):
                return json.loads(line)
    reached = last_progress(stderr)  # the compiler writes its progress lines to stderr
    if killed:
        return {**base, "stage": "timeout" if killed.startswith("timeout") else "memory", "seconds": secs,
                "progress": reached, "error": f"stopped: {killed}; the compiler had reached: "
                                              f"{reached or 'no progress line'}"}
    assert code is not None
    how = f"signal {-code}" if code < 0 else f"exit status {code}"
    return {**base, "stage": "crashed", "seconds": secs, "progress": reached,
            "error": f"the compile process died ({how}): {stderr[-3000:].strip()}",
            "refused_ops": refused_ops(stderr)}


# ---------------------------------------------------------------- the card worker (hardware only)


class CardWorker:
    """What the RngdRuntime worker does with each message, on one device: the compiled graphs,
    every layer's weights and the KV caches resident there. `build(spec, kv_dtype)` returns one
    graph as a callable on `device` (on a card `card_builder`: `build_graph`, the artifact or the
    compile, loaded with `.to(furiosa:N)`; tests pass the exported program's own module on the
    CPU, to run this logic against the model without a card).

    A prompt shorter than a compiled chunk is padded with zero rows after its last token (causal
    attention: its rows never see them; the head reads row n - 1), a past up to its bucket (masked
    in the graph); a decode step of fewer rows than a compiled width with copies of its first row
    (same token, position and slot: the padded rows write the same bits to the same place)."""

    def __init__(self, model: Any, device: Any, build: Any, memory: Any = None) -> None:
        self.model, self.device, self.build, self.memory = model, device, build, memory
        self.weights = [tuple(w.to(device) for w in ws) for ws in layer_weights(model)]
        self.head_w = tuple(w.to(device) for w in head_weights(model))
        self.graphs: dict[str, Any] = {}
        self.chunks: list[int] = []
        self.pasts: list[int] = []
        self.caches: dict[int, list[Any]] = {}
        self._ids = iter(range(1, 1 << 62))

    def handle(self, msg: dict[str, Any], ts: list[Any]) -> tuple[dict[str, Any], list[Any]]:
        """One request -> (reply header, reply tensors); raises on a bad request."""
        import torch

        op, model, dev, c = msg["op"], self.model, self.device, self.model.config
        if op == "prepare":
            rows = []
            decode = tuple(tuple(d) for d in msg["decode"])
            for spec in specs(tuple(msg["chunks"]), decode, tuple(msg["past"])):
                if spec.name in self.graphs:  # each engine prepares what it needs; a graph loads once
                    continue
                t0 = time.perf_counter()
                try:
                    self.graphs[spec.name] = self.build(spec, torch_dtype(msg["kv_dtype"]))
                    rows.append({"name": spec.name, "shape": spec.shape, "ok": True})
                except Exception as exc:
                    rows.append({"name": spec.name, "shape": spec.shape, "ok": False,
                                 "error": _short(str(exc)), "refused_ops": refused_ops(str(exc))})
                rows[-1]["seconds"] = round(time.perf_counter() - t0, 2)
            self.chunks = sorted(set(self.chunks) | set(msg["chunks"]))
            self.pasts = sorted(set(self.pasts) | set(msg["past"]))
            return {"rows": rows}, []
        if op == "new_cache":
            shape = (msg["slots"], c.num_kv_heads, msg["max_len"], c.head_dim)
            cache = next(self._ids)
            self.caches[cache] = [torch.zeros(shape, dtype=torch_dtype(msg["kv_dtype"])).to(dev)
                                  for _ in range(2 * c.num_layers)]
            return {"cache": cache}, []
        if op == "load":  # K/V [KVH, T, hd] of one layer (layer >= 0) or of all layers (-1)
            kv, slot, start = self.caches[msg["cache"]], msg["slot"], msg["start"]
            first = 0 if msg["layer"] < 0 else 2 * msg["layer"]
            for j, t in enumerate(ts):
                host = kv[first + j].cpu()  # read-modify-write through the host (no DMA API known)
                host[slot, :, start:start + t.shape[1]] = t.to(host.dtype)
                kv[first + j] = host.to(dev)
            return {}, []
        if op == "read":  # one layer's K, V of a slot at positions [start, end), to the host
            kv, at = self.caches[msg["cache"]], 2 * msg["layer"]
            return {}, [t[msg["slot"], :, msg["start"]:msg["end"]].cpu() for t in kv[at:at + 2]]
        if op == "prefill":  # tokens [n], then the past's K_0, V_0, ... [KVH, P, hd] (none: P = 0)
            n, p = int(ts[0].shape[0]), int(ts[1].shape[1]) if len(ts) > 1 else 0
            t = min(x for x in self.chunks if x >= n)  # RngdRuntime.prefill checked that one exists
            x = torch.zeros(t, c.hidden_size, dtype=model.dtype)
            x[:n] = model.embed_tokens(ts[0])
            name, past = f"prefill_layer_t{t}", None
            if p:
                bucket = min(x for x in self.pasts if x >= p)
                name += f"_l{bucket}"
                cos, sin = model._rope(*model.rope.span(p, t))
                padded = [torch.zeros(c.num_kv_heads, bucket, c.head_dim, dtype=k.dtype) for k in ts[1:]]
                for buf, k in zip(padded, ts[1:], strict=True):
                    buf[:, :p] = k
                mask = past_mask(p, bucket, t)
                past = (cos.to(dev), sin.to(dev), mask.to(dev), [b.to(dev) for b in padded])
            logits, kv = prefill_chain(self.graphs[name], self.graphs[f"prefill_head_t{t}"], x.to(dev),
                                       torch.tensor([n - 1]).to(dev), self.weights, self.head_w, past)
            return {}, [logits.cpu(), *(k.cpu()[:, :n] for k in kv)]
        if op == "decode":
            kv = self.caches[msg["cache"]]
            tokens, positions, slots = ts
            rows, width = int(tokens.shape[0]), kv[0].shape[0]
            pad = width - rows
            if pad:
                tokens, positions, slots = (torch.cat([v, v[:1].expand(pad)]) for v in ts)
            logits, self.caches[msg["cache"]] = decode_chain(
                self.graphs[f"decode_layer_b{width}_l{kv[0].shape[2]}"], self.graphs[f"decode_head_b{width}"],
                model.embed_tokens(tokens).to(dev), positions.to(dev), slots.to(dev), kv, self.weights,
                self.head_w)
            return {}, [logits.cpu()[:rows]]
        if op == "memory":
            if self.memory is None:
                raise RngdPdError("no memory query for this device")
            mem = self.memory()
            return {"total": mem["total_bytes"], "free": mem["total_bytes"] - mem["in_use_bytes"],
                    "detail": {"source": "furiosa-smi", **mem}}, []
        raise ValueError(f"unknown op {op!r}")

    def answer(self, msg: dict[str, Any], ts: list[Any]) -> tuple[dict[str, Any], list[Any]]:
        """`handle`, with a failure as the reply's "error" (the runtime raises it as RngdPdError)."""
        try:
            return self.handle(msg, ts)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {_short(str(exc), 2000)}"}, []


def serve(index: int, source: str, dtype: str, options: CompileOptions) -> int:  # pragma: no cover - a card
    """The RngdRuntime worker: messages on stdin/stdout (rngd_pd.devices.rngd.messages) handled
    by a CardWorker on `furiosa:<index>`, its graphs from `card_builder` (the artifacts in
    `options.artifacts`, or compiled with `options.search`, said on stderr: the model's log). NOT
    verified on a card: the load onto the device and the calls are written against furiosa-torch
    2026.4's sources (CompileModule, .to(device), forward); the message handling runs in tests with
    CPU graphs, and `card_builder` up to the device in the RNGD tests."""
    import torch

    dev = torch.device(f"furiosa:{index}")
    loaded = load_model(source, dtype=torch_dtype(dtype), progress=False)
    build = card_builder(loaded.model, dev, options, _log)
    worker = CardWorker(loaded.model, dev, build, lambda: memory(index))
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but messages on the pipe
    while True:
        try:
            msg, ts = read_message(stdin)
        except EOFError:
            return 0
        header, out = worker.answer(msg, ts)
        stdout.write(pack_message(header, out))
        stdout.flush()


def _log(text: str) -> None:
    print(f"rngd: {text}", file=sys.stderr, flush=True)


def _spec_by_name(name: str) -> GraphSpec:
    m = re.fullmatch(r"prefill_(layer|head)_t(\d+)(?:_l(\d+))?|decode_layer_b(\d+)_l(\d+)|decode_head_b(\d+)",
                     name)
    if not m:
        raise SystemExit(f"unknown graph {name!r} (prefill_layer_t<T>[_l<L>], prefill_head_t<T>, "
                         "decode_layer_b<B>_l<L> or decode_head_b<B>)")
    if m.group(1):
        return GraphSpec("prefill", m.group(1), t=int(m.group(2)), l=int(m.group(3) or 0))
    if m.group(4):
        return GraphSpec("decode", "layer", b=int(m.group(4)), l=int(m.group(5)))
    return GraphSpec("decode", "head", b=int(m.group(6)))


def _row_text(row: dict[str, Any], as_json: bool) -> str:
    if as_json:
        return json.dumps(row)
    status = ("reused" if row.get("source") == "artifacts" else "ok") if row.get("ok") \
        else f"FAILED at {row.get('stage')}"
    return (f"{row['name']:<22} {row['dtype']:<5} {status:<22} {row.get('seconds', {}).get('total', '?')} s"
            + (f"  refused {row['refused_ops']}" if row.get("refused_ops") else "")
            + (f"\n    {row['error'][-600:]}" if row.get("error") else ""))


def _print_row(row: dict[str, Any], as_json: bool) -> None:
    print(_row_text(row, as_json), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rngd_pd.devices.rngd.graphs",
                                 description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--compile-only", action="store_true",
                    help="export and compile (the only mode: running needs a card)")
    ap.add_argument("--chunks", type=parse_chunks, default=DEFAULT_SHAPES.prefill_chunks,
                    help="prefill chunk lengths, e.g. 128,512")
    ap.add_argument("--past", type=parse_chunks, default=(),
                    help="past buckets a prefill chunk after earlier chunks attends over, e.g. 512,1024")
    ap.add_argument("--decode", type=parse_decode, default=DEFAULT_SHAPES.decode,
                    help="decode BxL shapes, e.g. 1x512,8x2048")
    ap.add_argument("--dtype", default="bf16", choices=COMPUTE_DTYPES, help="compute dtype of the weights")
    ap.add_argument("--kv-dtype", default="bf16", choices=KV_DTYPES)
    ap.add_argument("--json", action="store_true", help="one JSON line per graph")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per graph")
    ap.add_argument("--no-cache", action="store_true", help="do not use the furiosa compiler cache")
    ap.add_argument("--stage", choices=STAGES, default="compile",
                    help="how far to go: import (the DFG import that refuses ops), lower, compile")
    ap.add_argument("--tactic-hint", help="a furiosa TacticHintConfig name, e.g. ForLlmModelIOBound")
    ap.add_argument("--search", type=parse_search, default=DEFAULT_SEARCH,
                    help=f"the compiler's tactic search: `full` (furiosa's default) or a bound of N unique "
                         f"shapes (max_num_unique_shapes; default {DEFAULT_SEARCH}: the prefill layer "
                         "compiles in minutes, not hours; its tactics may run slower on a card)")
    ap.add_argument("--artifacts", default="",
                    help="--compile-only --stage compile: the artifact directory: graphs it holds are "
                         "skipped, the others compiled into it; --serve: load graphs from it")
    ap.add_argument("--progress", action="store_true", help="a progress bar on stderr")
    ap.add_argument("--only", type=lambda t: {n.strip() for n in t.split(",") if n.strip()}, default=set(),
                    help="only these graphs (names, comma-separated) of the shapes' graphs")
    ap.add_argument("--model", default=None, help="GGUF file or checkpoint directory (default: embedded)")
    ap.add_argument("--max-rss-gb", type=float, default=12.0,
                    help="kill a compile whose resident memory passes this (0: no limit)")
    ap.add_argument("--toolchain", action="store_true",
                    help="check the aarch64 cross compiler the furiosa compiler needs (and exit)")
    ap.add_argument("--install", action="store_true",
                    help="--toolchain: install it with apt-get when missing and running as root")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the child: compile this graph in-process
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # RngdRuntime's worker
    ap.add_argument("--device-index", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.toolchain:
        return ensure_toolchain(install=args.install)
    if args.serve:
        return serve(args.device_index, args.model, args.dtype, CompileOptions(args.search, args.artifacts))
    if args.one:
        row = compile_one(_spec_by_name(args.one), args)
        _print_row(row, True)
        return 0 if row["ok"] else 1
    store = ArtifactStore(args.artifacts) if args.artifacts and args.stage == "compile" else None
    config = open_checkpoint(args.model).config() if store else None
    failed = 0
    every = specs(args.chunks, args.decode, args.past)
    todo = [g for g in every if not args.only or g.name in args.only]
    if args.only - {g.name for g in todo}:
        raise SystemExit(f"--only {sorted(args.only - {g.name for g in todo})}: not among these shapes' "
                         f"graphs {[g.name for g in every]}")
    bar = tqdm(todo, unit="graph", file=sys.stderr, disable=not args.progress, dynamic_ncols=True)
    for spec in bar:
        bar.set_postfix_str(spec.name)
        key = artifact_key(config, spec, args.dtype, args.kv_dtype, args.search) if store else None
        info = store.find(key) if store and key else None
        row = _reused_row(spec, args, info) if info else run_child(spec, args)
        failed += not row.get("ok")
        bar.write(_row_text(row, args.json), file=sys.stdout)
        sys.stdout.flush()  # a row as each graph is done: rngd-pd compile reads them from a pipe
    return 1 if failed else 0


def _reused_row(spec: GraphSpec, args: argparse.Namespace, info: dict[str, Any]) -> dict[str, Any]:
    """The row of a graph the artifact directory holds already: nothing compiled."""
    return {**_row_base(spec, args), "ok": True, "stage": "done", "source": "artifacts", "error": "",
            "binary_bytes": info["bytes"], "artifact": str(ArtifactStore(args.artifacts).root),
            "seconds": {"total": 0.0}, "sdk": info.get("sdk", {})}


if __name__ == "__main__":
    sys.exit(main())
