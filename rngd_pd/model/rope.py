"""Rotary position embeddings (HF rotate-half convention), including Llama-3 "llama3" scaling.

The cos/sin table is computed once in fp32 up to the length asked for and grown by doubling, so a
decode step only gathers rows of it.
"""

from __future__ import annotations

import math
import threading

import torch
from torch import Tensor

from rngd_pd.errors import ModelLoadError


def inv_freq(head_dim: int, theta: float, scaling: dict | None) -> Tensor:
    """Per-pair inverse frequencies [head_dim // 2] fp32, with the checkpoint's rope scaling applied."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return freqs.float()
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return (freqs / float(scaling["factor"])).float()
    if kind == "llama3":
        return _llama3(freqs, scaling).float()
    if kind == "freq_factors":  # GGUF's rope_freqs.weight: llama3 scaling precomputed by llama.cpp
        return (freqs / torch.tensor(scaling["factors"], dtype=torch.float64)).float()
    raise ModelLoadError(
        f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3, GGUF rope_freqs); "
        "use a checkpoint with one of those"
    )


def _llama3(freqs: Tensor, s: dict) -> Tensor:
    """Llama-3.1 frequency-dependent scaling: long wavelengths slowed by `factor`, smooth in between."""
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_len = float(s.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > old_len / low, freqs / factor, freqs)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RopeTable:
    """cos/sin rows [positions, head_dim] (halves duplicated) for rotate-half RoPE.

    Thread-safe: prefill and decode threads may share one model; the table only ever grows, under a
    lock, and each lookup reads one (cos, sin) pair.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_len: int) -> None:
        self.inv_freq = inv_freq(head_dim, theta, scaling)
        self.max_len = max_len
        self._lock = threading.Lock()
        self._table = self._build(min(max_len, 4096))

    def _build(self, n: int) -> tuple[Tensor, Tensor]:
        f = torch.outer(torch.arange(n, dtype=torch.float32), self.inv_freq)  # [n, hd/2]
        emb = torch.cat([f, f], dim=-1)  # [n, hd]
        return emb.cos(), emb.sin()

    def rows(self, n: int) -> tuple[Tensor, Tensor]:
        """The (cos, sin) tables holding at least rows [0, n)."""
        table = self._table
        if n > table[0].shape[0]:
            with self._lock:
                table = self._table
                if n > table[0].shape[0]:
                    table = self._table = self._build(max(n, min(self.max_len, 2 * table[0].shape[0])))
        return table

    def span(self, start: int, length: int) -> tuple[Tensor, Tensor]:
        """cos, sin for positions [start, start + length): [length, hd]."""
        cos, sin = self.rows(start + length)
        return cos[start : start + length], sin[start : start + length]

    def gather(self, positions: Tensor, max_pos: int) -> tuple[Tensor, Tensor]:
        """cos, sin for arbitrary positions [B] -> [B, hd] (max_pos: the largest of them)."""
        cos, sin = self.rows(max_pos + 1)
        return cos[positions], sin[positions]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [..., T, hd] by cos/sin [T, hd] broadcast over the leading dims (rotate-half form)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin
