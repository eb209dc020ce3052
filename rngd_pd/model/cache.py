"""Static KV cache: allocated (and pre-faulted) once, reused by every decode step.

Layout per layer: [num_slots, kv_heads, max_len, head_dim]. A slot holds one sequence; the engine
decides which slot a request uses and how long it is (the cache itself keeps no lengths, so
nothing here changes per token except the K/V rows the step writes).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rngd_pd.errors import ConfigError
from rngd_pd.model.config import ModelConfig


class KVCache:
    """Per-layer K and V tensors for `num_slots` sequences of up to `max_len` tokens."""

    def __init__(
        self, config: ModelConfig, num_slots: int, max_len: int, dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        if num_slots < 1 or max_len < 1:
            raise ConfigError(f"KVCache needs num_slots >= 1 and max_len >= 1, got {num_slots}, {max_len}")
        self.config = config
        self.num_slots = num_slots
        self.max_len = max_len
        self.dtype = dtype
        shape = (num_slots, config.num_kv_heads, max_len, config.head_dim)
        # zeros() touches every page now, so no step pays page faults later.
        n = config.num_layers
        self.k: list[Tensor] = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)]
        self.v: list[Tensor] = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)]

    @property
    def nbytes(self) -> int:
        """Bytes held by the whole cache."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def load(self, slot: int, layer: int, k: Tensor, v: Tensor, start: int = 0) -> None:
        """Copy one layer's K/V [kv_heads, T, head_dim] into `slot` at positions [start, start + T).

        Called by the decode side after a transfer (or by a colocated prefill). A dtype different
        from the cache's is converted by copy_, a host tensor copied to the cache's device; a shape
        mismatch is a ConfigError.
        """
        self._check(slot, layer, k, start)
        if v.shape != k.shape:
            raise ConfigError(f"K {tuple(k.shape)} and V {tuple(v.shape)} shapes differ for layer {layer}")
        t = k.shape[1]
        self.k[layer][slot, :, start : start + t].copy_(k)
        self.v[layer][slot, :, start : start + t].copy_(v)

    def read(self, slot: int, layer: int, start: int, end: int) -> tuple[Tensor, Tensor]:
        """One layer's K/V of `slot` at positions [start, end), [kv_heads, end - start, head_dim]:
        views on the cache's device (a device cache without host views returns host copies)."""
        return self.k[layer][slot, :, start:end], self.v[layer][slot, :, start:end]

    def load_all(self, slot: int, kv: list[tuple[Tensor, Tensor]], start: int = 0) -> None:
        """Load every layer's (K, V) of one sequence (e.g. a prefill result) into `slot`."""
        if len(kv) != self.config.num_layers:
            raise ConfigError(f"got K/V for {len(kv)} layers, the model has {self.config.num_layers}")
        for i, (k, v) in enumerate(kv):
            self.load(slot, i, k, v, start)

    def _check(self, slot: int, layer: int, k: Tensor, start: int) -> None:
        c = self.config
        if not 0 <= slot < self.num_slots:
            raise ConfigError(f"slot {slot} out of range [0, {self.num_slots})")
        if not 0 <= layer < c.num_layers:
            raise ConfigError(f"layer {layer} out of range [0, {c.num_layers})")
        if k.dim() != 3 or k.shape[0] != c.num_kv_heads or k.shape[2] != c.head_dim:
            raise ConfigError(
                f"K/V shape {tuple(k.shape)} does not match [kv_heads={c.num_kv_heads}, T, "
                f"head_dim={c.head_dim}]"
            )
        if start < 0 or start + k.shape[1] > self.max_len:
            raise ConfigError(
                f"positions [{start}, {start + k.shape[1]}) do not fit a cache of max_len {self.max_len}"
            )
