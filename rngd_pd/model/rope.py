"""Rotary position embeddings (HF rotate-half convention), including Llama-3 "llama3" scaling.

The cos/sin table is computed once in fp32 up to the length asked for and grown by doubling, so a
decode step only gathers rows of it.
"""

from __future__ import annotations

import math

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
    """cos/sin rows [positions, head_dim] (halves duplicated) for rotate-half RoPE."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_len: int) -> None:
        self.inv_freq = inv_freq(head_dim, theta, scaling)
        self.max_len = max_len
        self.cos = torch.empty(0, head_dim)
        self.sin = torch.empty(0, head_dim)
        self._grow(min(max_len, 4096))

    def _grow(self, n: int) -> None:
        t = torch.arange(n, dtype=torch.float32)
        f = torch.outer(t, self.inv_freq)  # [n, hd/2]
        emb = torch.cat([f, f], dim=-1)  # [n, hd]
        self.cos, self.sin = emb.cos(), emb.sin()

    def ensure(self, n: int) -> None:
        """Make rows [0, n) available (n must not exceed the model's max_context)."""
        if n > self.cos.shape[0]:
            self._grow(max(n, min(self.max_len, 2 * self.cos.shape[0])))

    def span(self, start: int, length: int) -> tuple[Tensor, Tensor]:
        """cos, sin for positions [start, start + length): [length, hd]."""
        self.ensure(start + length)
        return self.cos[start : start + length], self.sin[start : start + length]

    def gather(self, positions: Tensor, max_pos: int) -> tuple[Tensor, Tensor]:
        """cos, sin for arbitrary positions [B] -> [B, hd] (max_pos: the largest of them)."""
        self.ensure(max_pos + 1)
        return self.cos[positions], self.sin[positions]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [..., T, hd] by cos/sin [T, hd] broadcast over the leading dims (rotate-half form)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin
