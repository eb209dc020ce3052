"""Llama in plain torch with the KV cache passed in and out explicitly (no hidden module state).

`prefill` (one prompt, or a chunk of one after `past`) and `decode_step` (B sequences, one token
each, at their own positions, against a static KVCache) are separate functions: they are the two
graphs a prefill device and a decode device run. GQA, RMSNorm, RoPE (llama3 scaling), SwiGLU.
Projections are fused (QKV, gate+up) so a step issues as few matmuls as possible.

Batch invariance: a row's decode logits are bit-identical whatever the number, content and lengths
of the other rows in its step, in fp32 and bf16 (batching must not change a greedy answer). What
varies with the batch are the shapes of the step's kernels, and CPU kernels choose code paths by
shape. Measured (torch 2.13, AVX-512 host, 1-8 threads; oneDNN also capped at AVX2):

* Projections. `F.linear` in fp32 gives a row other bits at M = 1, at M = 2-3 and at M >= 4 rows
  (and at 2 threads by the row's position too, for M = 5-7 and 9-11). oneDNN's linear on packed
  weights gives every row the same bits for every M in 1..64 at any position, except for the down
  projection (K = 1536) at M = 1, in fp32 and bf16 alike. So decode runs the projections on packed
  weights in both dtypes (in fp32 a step is also 1.5-2.5x faster than with `F.linear`, for one more
  copy of the weights in memory), and a projection that a kernel treats differently below m rows
  runs a smaller step zero-padded to m rows: `Llama._min_rows` measures m per projection at
  `prepare_decode` (here w2: 2, the rest 1), so only a one-row step pays: one padding row in each
  down projection, ~0.3 ms of a 15-23 ms step.
* Attention: a row attends over the longest length L of its group, masked (a step's rows attend per
  cache, and within a cache in groups by length, `_length_groups`), by torch's SDPA, one call per run
  of consecutive slots (its CPU flash kernel reads the cache's strided views with no copy and splits
  work by row and head, never across rows). A row's output has other bits when its length is not a
  multiple of 16 keys and the group's L is longer (the kernel's vector blocks then cut its keys
  elsewhere); so L is rounded up to a multiple of 16 (`_attention_length`, zero keys past a short
  cache's end). Measured: the same bits for every row count, neighbour, L up to 1,500 keys (across
  the kernel's 512-key blocks) and thread count (tests/test_batch_invariance.py).
* Embedding, norms, RoPE, SwiGLU and the K/V writes are row-wise and exact whatever the batch.

Prefill is not involved: it runs one prompt at a time and never shares a kernel call with others.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rngd_pd.errors import ConfigError
from rngd_pd.model.cache import KVCache
from rngd_pd.model.config import ModelConfig
from rngd_pd.model.rope import RopeTable, apply_rope

KV = list[tuple[Tensor, Tensor]]
OnLayer = Callable[[int, Tensor, Tensor], None]

log = logging.getLogger(__name__)


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


Packed = dict[str, Tensor]  # weight name -> oneDNN-packed copy (decode only)
Rows = dict[str, int]  # weight name -> the fewest rows decode runs it on (Llama._min_rows)
_PACK_ROWS = 16  # the batch width oneDNN packs the decode weights for (1..16 measured alike)
_CHECK_ROWS = 16  # row counts 1..16 are checked for batch invariance at prepare_decode
_CHECK_OUTPUTS = 1 << 16  # outputs compared per projection and row count (see Llama._min_rows)
_ATTN_BLOCK = 16  # decode attention lengths are rounded up to a multiple of this (module docstring)
_SPLIT_KEYS = 256  # decode rows attend in groups by length only past this many keys (_length_groups)


def _packable(dtype: torch.dtype) -> bool:
    """oneDNN packed linears exist here: bf16 on avx512_bf16 CPUs (measured 25-35% faster GEMVs than
    F.linear), fp32 wherever torch has oneDNN (batch-invariant where F.linear is not; module docstring)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _pack(w: Tensor) -> Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS)


def _linear(x: Tensor, w: Tensor, packed: Packed | None, name: str, rows: Rows | None = None) -> Tensor:
    """x @ w.T, through the packed copy of w when there is one; x of fewer than rows[name] rows
    runs padded with zero rows to that many (batch invariance, module docstring)."""
    n, least = x.shape[0], rows.get(name, 1) if rows else 1
    if n < least:
        x = torch.cat([x, x.new_zeros(least - n, x.shape[1])])
    if packed is not None and name in packed:
        y = torch.ops.mkldnn._linear_pointwise(x, packed[name], None, "none", [], "")
    else:
        y = F.linear(x, w)
    return y[:n] if n < least else y


class Block(nn.Module):
    """One decoder layer's weights: fused QKV, output, fused gate/up, down, two RMSNorm weights."""

    def __init__(self, c: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        self.attn_norm = _param(c.hidden_size, dtype=dtype)
        self.wqkv = _param(qkv_rows, c.hidden_size, dtype=dtype)
        self.wo = _param(c.hidden_size, c.num_heads * c.head_dim, dtype=dtype)
        self.ffn_norm = _param(c.hidden_size, dtype=dtype)
        self.w13 = _param(2 * c.intermediate_size, c.hidden_size, dtype=dtype)
        self.w2 = _param(c.hidden_size, c.intermediate_size, dtype=dtype)
        self.eps = c.rms_norm_eps
        self.head_dim = c.head_dim
        self.split = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim)
        self.packed: Packed | None = None  # set by Llama.pack_weights; used by decode_step only

    def pack(self) -> None:
        """Keep oneDNN-packed copies of the four projections for the decode GEMVs."""
        self.packed = {n: _pack(getattr(self, n)) for n in ("wqkv", "wo", "w13", "w2")}

    def norm(self, x: Tensor, w: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [N, D] -> q [N, H*hd], k [N, KVH*hd], v [N, KVH*hd] (views of one matmul)."""
        return F.linear(self.norm(x, self.attn_norm), self.wqkv).split(self.split, dim=-1)

    def qkv_heads(
        self, x: Tensor, packed: Packed | None = None, rows: Rows | None = None
    ) -> tuple[Tensor, Tensor]:
        """x [N, D] -> qk [N, H+KVH, hd] (RoPE rotates q and k in one pass), v [N, KVH, hd]: views."""
        out = _linear(self.norm(x, self.attn_norm), self.wqkv, packed, "wqkv", rows)
        n, hd = out.shape[0], self.head_dim
        qk, v = out.split((self.split[0] + self.split[1], self.split[2]), dim=-1)
        return qk.view(n, -1, hd), v.view(n, -1, hd)

    def finish(
        self, x: Tensor, attn: Tensor, packed: Packed | None = None, rows: Rows | None = None
    ) -> Tensor:
        """Residual add of the attention output attn [N, H*hd], then the SwiGLU MLP."""
        x = x + _linear(attn, self.wo, packed, "wo", rows)
        gate, up = _linear(self.norm(x, self.ffn_norm), self.w13, packed, "w13", rows).chunk(2, dim=-1)
        return x + _linear(F.silu(gate) * up, self.w2, packed, "w2", rows)


class Llama(nn.Module):
    """Weights plus the two forward functions; dtype is the compute dtype (fp32 or bf16)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        c = self.config = config
        self.dtype = dtype
        self.embed = _param(c.vocab_size, c.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(Block(c, dtype) for _ in range(c.num_layers))
        self.norm = _param(c.hidden_size, dtype=dtype)
        self.lm_head = (
            self.embed if c.tie_word_embeddings else _param(c.vocab_size, c.hidden_size, dtype=dtype)
        )
        self.rope = RopeTable(c.head_dim, c.rope_theta, c.rope_scaling, c.max_context)
        self.requires_grad_(False)
        self.head_packed: Packed | None = None
        self.decode_rows: Rows = {}  # the fewest rows decode runs each projection on (_min_rows)
        self.decode_invariant = True  # _min_rows found such a row count for every projection
        self._packing_done = False  # pack_weights ran (whether or not this device/dtype packs)
        self.pack = True  # whether pack_weights may pack (DecodeParams.pack_weights)
        self._pack_lock = threading.RLock()

    def pack_weights(self) -> None:
        """(Re)build the packed decode weights and re-measure `decode_rows`; decode_step calls
        it once, call it again after changing weights in place. Costs one more copy of the weights
        in memory, CPU only (SmolLM2: 270 MB in bf16, 560 MB in fp32)."""
        with self._pack_lock:
            self._packing_done = True
            if self.pack and _packable(self.dtype) and self.embed.device.type == "cpu":
                try:
                    for layer in self.layers:
                        layer.pack()
                    self.head_packed = {"lm_head": _pack(self.lm_head)}
                except RuntimeError as ex:  # a oneDNN build without these kernels: plain F.linear
                    log.info("decode weights stay unpacked (%s): %s", self.dtype, ex)
                    for layer in self.layers:
                        layer.packed = None
                    self.head_packed = None
            self.decode_rows, self.decode_invariant = self._min_rows()
            if not self.decode_invariant:
                log.warning(
                    "decode is not batch-invariant here (%s, %s, %d threads): no row count up to %d "
                    "gives every row the same bits, so batching can change a greedy answer",
                    self.dtype, self.embed.device, torch.get_num_threads(), _CHECK_ROWS,
                )

    def prepare_decode(self) -> None:
        """Pack the decode weights and measure `decode_rows` once (idempotent); engines call it
        at start so that the first decode step does not pay for it (~0.3 s for SmolLM2)."""
        with self._pack_lock:
            if not self._packing_done:
                self.pack_weights()

    @torch.inference_mode()
    def _min_rows(self) -> tuple[Rows, bool]:
        """For each decode projection (one layer's four and the LM head; the other layers have the
        same shapes) the smallest m such that it gives a row the same bits for every row count M in
        [m, _CHECK_ROWS] at any row position; and whether every projection has one.

        Kernels pick their code paths by shape and thread count, never by values, so random rows
        show it: each row count M runs a pool of random vectors M at a time, shifted so that each
        vector sits at another position than in the reference (the pool at 16 rows a call), and
        every output must equal the reference bit for bit. A bf16 output hides most changes of the
        fp32 summation order under its rounding (measured: 1 output in ~4000 differs), so the pool
        gives ~65k outputs per M. Measured with the torch threads set now (serving sets them
        before the engine starts); ~0.2 s for SmolLM2.
        """
        layer = self.layers[0]
        mats = [(layer.wqkv, layer.packed, "wqkv"), (layer.wo, layer.packed, "wo"),
                (layer.w13, layer.packed, "w13"), (layer.w2, layer.packed, "w2"),
                (self.lm_head, self.head_packed, "lm_head")]  # fmt: skip
        gen = torch.Generator().manual_seed(0)
        rows: Rows = {}
        for w, packed, name in mats:
            n, k = w.shape
            pool = -(-_CHECK_OUTPUTS // (n * _CHECK_ROWS)) * _CHECK_ROWS  # vectors, a multiple of 16
            xs = torch.randn(pool, k, generator=gen).to(w.dtype).to(w.device)
            ref = torch.cat([_linear(x, w, packed, name) for x in xs.split(_CHECK_ROWS)])
            rows[name] = 1
            for m in range(_CHECK_ROWS, 0, -1):
                calls = -(-_CHECK_OUTPUTS // (n * m))
                order = torch.arange(m + 1, m + 1 + calls * m) % pool  # each vector moved to another row
                got = torch.cat([_linear(xs[o], w, packed, name) for o in order.split(m)])
                if not torch.equal(got, ref[order]):
                    if m == _CHECK_ROWS:
                        return {}, False
                    rows[name] = m + 1
                    break
        return {k: v for k, v in rows.items() if v > 1}, True

    def _logits(self, x: Tensor, packed: Packed | None = None, rows: Rows | None = None) -> Tensor:
        """x [N, D] -> fp32 logits [N, vocab]."""
        x = F.rms_norm(x, (x.shape[-1],), self.norm, self.config.rms_norm_eps)
        return _linear(x, self.lm_head, packed, "lm_head", rows).float()

    def _rope(self, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        dev = self.embed.device  # the tables stay on the host; a step's rows go where the weights are
        return cos.to(dev, self.dtype), sin.to(dev, self.dtype)

    @torch.inference_mode()
    def prefill(
        self,
        tokens: Tensor,
        past: KV | None = None,
        on_layer: OnLayer | None = None,
        kv_dtype: torch.dtype = torch.bfloat16,
        all_logits: bool = False,
    ) -> tuple[Tensor, KV]:
        """Run T prompt tokens after P cached ones; return last logits [vocab] (every position's,
        [T, vocab], with `all_logits`: prompt logprobs) and the new (K, V).

        K/V per layer are [kv_heads, T, head_dim] in kv_dtype; on_layer(i, K, V) gets them as soon
        as layer i computed them. Attention reads the kv_dtype-rounded values, as decode will.
        """
        c = self.config
        t = int(tokens.shape[0])
        p = int(past[0][0].shape[1]) if past else 0
        if t < 1:
            raise ConfigError("prefill needs at least one token")
        if past is not None and len(past) != c.num_layers:
            raise ConfigError(f"past has K/V for {len(past)} layers, the model has {c.num_layers}")
        x = self.embed_tokens(tokens)
        cos, sin = self._rope(*self.rope.span(p, t))  # [T, hd]
        out: KV = []
        for i, layer in enumerate(self.layers):
            x, k, v = self.prefill_layer(layer, x, cos, sin, None, past[i] if past else None, kv_dtype)
            out.append((k, v))
            if on_layer is not None:
                on_layer(i, k, v)
        return (self._logits(x) if all_logits else self._logits(x[-1:])[0]), out

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        """tokens [N] -> their embedding rows [N, D]: the one lookup every graph of the model starts
        with (the RNGD graphs take its result as input: docs/devices-rngd.md)."""
        return F.embedding(tokens, self.embed)

    def prefill_layer(
        self,
        layer: Block,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        blocks: list[QueryBlock] | None,
        past: tuple[Tensor, Tensor] | None,
        kv_dtype: torch.dtype,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One decoder layer of prefill, x [T, D] -> (x, K, V): a function of the layer's weights, so
        an NPU compiles it once and calls it for every layer with that layer's weights (rngd.graphs).

        blocks None: causal attention after the past by torch's SDPA (its flash kernel); an NPU graph
        passes its query blocks and masks instead (`_attend_causal`: plain matmuls it can lower)."""
        c, t = self.config, int(x.shape[0])
        q, k, v = layer.qkv(x)
        q = apply_rope(q.view(t, c.num_heads, c.head_dim).transpose(0, 1), cos, sin)  # [H, T, hd]
        k = apply_rope(k.view(t, c.num_kv_heads, c.head_dim).transpose(0, 1), cos, sin)  # [KVH, T, hd]
        k = k.to(kv_dtype).contiguous()
        v = v.view(t, c.num_kv_heads, c.head_dim).transpose(0, 1).to(kv_dtype).contiguous()
        kk, vv = k.to(self.dtype), v.to(self.dtype)
        if past is not None:
            kk = torch.cat([past[0].to(self.dtype), kk], dim=1)  # [KVH, P+T, hd]
            vv = torch.cat([past[1].to(self.dtype), vv], dim=1)
        scale = c.head_dim**-0.5
        o = _attend_causal(q, kk, vv, blocks, scale) if blocks is not None else \
            _attend_causal_sdpa(q, kk, vv, scale)  # [H, T, hd]
        return layer.finish(x, o.transpose(0, 1).reshape(t, -1)), k, v

    @torch.inference_mode()
    def decode_step(self, tokens: Tensor, positions: Tensor, cache: KVCache, slots: Tensor) -> Tensor:
        """One token for each of B sequences: writes its K/V at (slot, position), returns logits [B, V].

        Row b attends over its slot's positions [0, positions[b]]; rows may have different lengths.
        Batch-invariant (module docstring): a projection that a kernel treats differently below
        `decode_rows[name]` rows runs on zero-padded rows; attention runs over the longest row
        rounded up to a multiple of 16 positions.
        """
        return self.decode_step_parts(tokens, positions, [(cache, slots)])

    def decode_step_parts(self, tokens: Tensor, positions: Tensor, parts: list[StepPart]) -> Tensor:
        """`decode_step` over rows that live in several caches (an engine's sequence buckets).

        parts[i] = (cache, slots) owns the next len(slots) rows of tokens / positions, in order. The
        projections, norms and the LM head read the weights once for all rows; only the K/V writes
        and the attention run per part, each over its own longest row. A row gets the same bits as
        in `decode_step` over its part alone (the attention of a part sees only that part's rows).
        """
        c = self.config
        if not self._packing_done:
            self.prepare_decode()
        b = int(tokens.shape[0])
        host_pos = positions.cpu()  # the same tensor on cpu
        views = _part_views(parts, positions, host_pos.tolist(), b, self.embed.device)
        cos, sin = self._rope(*self.rope.gather(host_pos, max(v.max_pos for v in views)))  # [B, hd]
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, hd] broadcast over heads
        rows = self.decode_rows
        x = self.embed_tokens(tokens)  # [B, D]
        for i, layer in enumerate(self.layers):
            qk, v = layer.qkv_heads(x, layer.packed, rows)  # [B, H+KVH, hd], [B, KVH, hd]
            qk = apply_rope(qk, cos, sin)
            q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]  # [B, H, hd], [B, KVH, hd]
            outs = [self._attend_part(i, view, q[view.rows], k[view.rows], v[view.rows]) for view in views]
            o = outs[0] if len(outs) == 1 else torch.cat(outs)  # [B, KVH, G, hd]
            x = layer.finish(x, o.reshape(b, -1), layer.packed, rows)
        return self._logits(x, self.head_packed, rows)

    def _attend_part(self, layer: int, p: _PartView, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Write one part's new K/V into its cache and attend its rows: q [n, H, hd] -> [n, KVH, G, hd]."""
        c = self.config
        ck, cv = p.cache.k[layer], p.cache.v[layer]
        ck[p.slots, :, p.positions] = k.to(ck.dtype)
        cv[p.slots, :, p.positions] = v.to(cv.dtype)
        n = q.shape[0]
        qg = q.view(n, c.num_kv_heads, c.num_heads // c.num_kv_heads, c.head_dim)  # G heads per KV head
        if len(p.groups) == 1:
            return self._attend_group(ck, cv, p.groups[0], qg)
        out = torch.empty_like(qg)
        for g in p.groups:
            out[g.index] = self._attend_group(ck, cv, g, qg[g.index])
        return out

    def _attend_group(self, ck: Tensor, cv: Tensor, g: _AttnGroup, qg: Tensor) -> Tensor:
        return _attend_runs(ck, cv, g, qg, self.dtype, self.config.head_dim**-0.5)


StepPart = tuple[KVCache, Tensor]
"""(cache, slots [n]): the rows of one decode step that live in one cache."""


class _AttnGroup:
    """Rows of one part that attend together, over their own longest row rounded up (`length`)."""

    def __init__(self, cache: KVCache, index: list[int] | None, slots: list[int], pos: list[int],
                 positions: Tensor, device: torch.device) -> None:
        self.index = None if index is None else torch.tensor(index, device=device)  # None: every row
        if index is not None:
            slots, pos, positions = [slots[i] for i in index], [pos[i] for i in index], positions[self.index]
        n = len(pos)
        _check_rows(slots, n, cache, pos)
        self.runs = _slot_runs(slots)
        self.length = _attention_length(max(pos) + 1)
        self.cached = min(self.length, cache.max_len)  # a cache shorter than that: the rest is zeros
        seen = torch.arange(self.length, device=device) <= positions[:, None]  # [n, L] cached, visible
        self.mask = seen.view(n, 1, 1, self.length)


class _PartView:
    """One part of a decode step, checked: its rows, and their attention groups by length."""

    def __init__(self, cache: KVCache, slots: Tensor, positions: Tensor, pos: list[int], start: int,
                 device: torch.device) -> None:
        n = len(pos)
        self.cache, self.slots, self.positions = cache, slots, positions
        self.rows = slice(start, start + n)
        host_slots = slots.tolist()
        _check_rows(host_slots, n, cache, pos)
        self.max_pos = max(pos)
        self.groups = [_AttnGroup(cache, index, host_slots, pos, positions, device)
                       for index in _length_groups(pos)]


def _length_groups(pos: list[int]) -> list[list[int] | None]:
    """Rows that attend together: a row whose keys are under half the longest's attends in a group of
    its own kind, so a short row does not read (and mask) the long row's keys; [None] = one group.

    The longest first; a group takes every row down to half its length. Below _SPLIT_KEYS keys a
    second group costs more calls than the keys it saves. A row's bits do not depend on the length it
    attends over (module docstring), so grouping changes no logits.
    """
    lengths = [_attention_length(p + 1) for p in pos]
    if max(lengths) < _SPLIT_KEYS or min(lengths) * 2 > max(lengths):
        return [None]
    groups: list[list[int] | None] = []
    order = sorted(range(len(pos)), key=lambda i: -lengths[i])
    while order:
        top = lengths[order[0]]
        short = (j for j, i in enumerate(order) if top >= _SPLIT_KEYS and lengths[i] * 2 <= top)
        cut = next(short, len(order))
        groups.append(sorted(order[:cut]))
        order = order[cut:]
    return groups


def _part_views(parts: list[StepPart], positions: Tensor, pos: list[int], b: int,
                device: torch.device) -> list[_PartView]:
    """The parts of a step as views of its rows; ConfigError when their slots do not cover the rows."""
    if not parts:
        raise ConfigError("decode_step needs at least one row")
    views, start = [], 0
    for cache, slots in parts:
        n = int(slots.shape[0])
        if n < 1 or start + n > b:
            sizes = [int(s.shape[0]) for _, s in parts]
            raise ConfigError(f"decode_step got {b} tokens but parts of {sizes} slots")
        views.append(_PartView(cache, slots, positions[start : start + n], pos[start : start + n], start,
                               device))
        start += n
    if start != b:
        raise ConfigError(f"decode_step got {b} tokens, {len(pos)} positions and {start} slots")
    return views


def _attention_length(n: int) -> int:
    """Keys a decode step attends over for a longest row of n tokens: n rounded up to a multiple of
    _ATTN_BLOCK, so that a row's key columns never fall in the QK^T matmul's partial last block nor
    below the softmax's vector width (module docstring). Past a cache's max_len the keys are zeros."""
    return -(-n // _ATTN_BLOCK) * _ATTN_BLOCK


def _attend(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> Tensor:
    """Decode attention as two batched matmuls, softmax in fp32 with an additive length mask: the
    form the RNGD graphs lower (rngd.graphs); the eager step uses `_attend_sdpa`.
    q [B, KVH, G, hd], k/v [B, KVH, L, hd], bias [B, 1, 1, L] -> [B, KVH, G, hd]."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [B, KVH, G, L]
    return torch.matmul(torch.softmax(scores + bias, dim=-1).to(v.dtype), v)


def _attend_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Decode attention by SDPA over the cache's views: q [B, KVH, G, hd], k/v [B, KVH, L, hd], mask
    [B, 1, 1, L] (True: attend) -> [B, KVH, G, hd]. With torch 2.13 on the CPU 1.3-2.3x faster in bf16
    than `_attend`, which needs a copy of K (docs/model.md, bench/decode_attention.py)."""
    b, kvh, g, hd = q.shape
    out = F.scaled_dot_product_attention(q.reshape(b, kvh * g, 1, hd), k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out.view(b, kvh, g, hd)


def _attend_runs(ck: Tensor, cv: Tensor, g: _AttnGroup, qg: Tensor, dtype: torch.dtype,
                 scale: float) -> Tensor:
    """A group's attention, one SDPA per run of consecutive slots over views of the cache layer ck/cv:
    qg [n, KVH, G, hd] -> [n, KVH, G, hd]. Gathering scattered slots copied their K/V every layer:
    2.2-4x slower per layer (bench/decode_attention.py, "8 rows, 2 runs")."""
    outs = []
    for rows, slots in g.runs:
        kk = ck[slots, :, : g.cached].to(dtype)  # views unless the dtypes differ
        vv = cv[slots, :, : g.cached].to(dtype)
        if g.cached < g.length:
            pad = g.length - g.cached
            kk, vv = F.pad(kk, (0, 0, 0, pad)), F.pad(vv, (0, 0, 0, pad))
        outs.append(_attend_sdpa(qg[rows], kk, vv, g.mask[rows], scale))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


QueryBlock = tuple[int, int, Tensor]
_BLOCK_ROWS = 128  # query rows per attention block: measured best of 64/128/256/512 here


def _causal_blocks(p: int, t: int, device: torch.device | None = None) -> list[QueryBlock]:
    """Query blocks (start, end, additive bias [rows, P+end]) for causal attention after P tokens."""
    out = []
    for s in range(0, t, _BLOCK_ROWS):
        e = min(t, s + _BLOCK_ROWS)
        hidden = torch.arange(p + e)[None, :] > (torch.arange(s, e)[:, None] + p)  # key after query
        out.append((s, e, torch.zeros(e - s, p + e).masked_fill_(hidden, float("-inf")).to(device)))
    return out


def _attend_causal(q: Tensor, k: Tensor, v: Tensor, blocks: list[QueryBlock], scale: float) -> Tensor:
    """Causal GQA attention by query blocks; each block reads only the keys it can see.

    Plain batched matmuls with the G query heads of a KV head stacked as rows (no K/V repeat): in
    bf16 ~4x faster than SDPA's CPU flash kernel at 512 tokens, ~1.4x at 2048; equal in fp32.
    q [H, T, hd], k/v [KVH, P+T, hd] -> [H, T, hd].
    """
    h, t, hd = q.shape
    kvh = k.shape[0]
    qg = q.view(kvh, h // kvh, t, hd)  # [KVH, G, T, hd]
    out = torch.empty_like(qg)
    kt = k.transpose(1, 2)  # [KVH, hd, P+T]
    for s, e, bias in blocks:
        n, keys = e - s, bias.shape[1]
        rows = qg[:, :, s:e].reshape(kvh, -1, hd)  # [KVH, G*n, hd]
        scores = torch.matmul(rows, kt[:, :, :keys]).float().mul_(scale).view(kvh, -1, n, keys)
        probs = torch.softmax(scores + bias, dim=-1).to(v.dtype).view(kvh, -1, keys)
        out[:, :, s:e] = torch.matmul(probs, v[:, :keys]).view(kvh, -1, n, hd)
    return out.view(h, t, hd)


def _attend_causal_sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Causal GQA attention of T queries after P = k.shape[1] - T past keys, by SDPA: q [H, T, hd],
    k/v [KVH, P+T, hd] -> [H, T, hd]. With torch 2.13 its CPU flash kernel beat the query blocks of
    `_attend_causal` 2.1-4.2x in bf16 (docs/model.md, bench/prefill_attention.py)."""
    t, keys = q.shape[1], k.shape[1]
    # is_causal aligns the diagonal top-left, right only without a past; after one, query i sees the
    # past and the chunk up to itself
    mask = None if keys == t else torch.ones(t, keys, dtype=torch.bool, device=q.device).tril_(keys - t)
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=mask is None,
                                          scale=scale, enable_gqa=True)[0]


def _slot_runs(slots: list[int]) -> list[tuple[slice, slice]]:
    """(rows, slots) of each run of consecutive slots, in row order: each reads the cache as a view.
    A row's bits do not depend on the other rows of its SDPA call (module docstring)."""
    runs, start = [], 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            runs.append((slice(start, i), slice(slots[start], slots[i - 1] + 1)))
            start = i
    return runs


def _check_rows(slots: list[int], b: int, cache: KVCache, pos: list[int]) -> None:
    """ConfigError unless b rows have b distinct slots and positions that fit the cache."""
    if b < 1:
        raise ConfigError("decode_step needs at least one row")
    if len(slots) != b or len(pos) != b:
        raise ConfigError(f"decode_step got {b} tokens, {len(pos)} positions and {len(slots)} slots")
    if min(slots) < 0 or max(slots) >= cache.num_slots or len(set(slots)) != b:
        raise ConfigError(f"slots {slots} must be distinct and in [0, {cache.num_slots})")
    if min(pos) < 0 or max(pos) >= cache.max_len:
        raise ConfigError(f"positions {pos} must be in [0, cache max_len {cache.max_len})")
