"""The decode step as a static-shape graph, for ahead-of-time compilers (rebel, furiosa).

`Llama.decode_step` is eager: it reads Python lists, picks views by slot, and attends over the
longest row's length, so its shapes change every step. A compiler needs one graph per (batch
width W, sequence bucket L) with everything a tensor:

    StaticDecode(model)(tokens [W], positions [W], k0, v0, ..., k{n-1}, v{n-1})
        -> logits [W, vocab] fp32, k_new0, v_new0, ... ([W, kv_heads, head_dim] each)

Row w is slot w of the caches [W, kv_heads, L, head_dim]; it attends over its cached positions
[0, positions[w]) plus its own new K/V (which the graph returns instead of writing: the caches are
inputs, so the host or the runtime writes the rows back). Same layers and weights as the eager
step, mathematically equal; its bits differ from the eager step (other kernels), so tests compare
logits within tolerance and greedy tokens exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from rngd_pd.model.llama import Llama
from rngd_pd.model.rope import apply_rope


class StaticDecode(nn.Module):
    """One batched decode step over whole caches (module docstring), in the model's dtype; the
    RoPE table covers positions below max_len (default: the model's context)."""

    def __init__(self, model: Llama, max_len: int | None = None) -> None:
        super().__init__()
        self.model = model
        self.dtype = model.dtype
        cos, sin = model.rope.rows(max_len or model.config.max_context)
        self.register_buffer("cos", cos.clone(), persistent=False)
        self.register_buffer("sin", sin.clone(), persistent=False)

    def forward(self, tokens: Tensor, positions: Tensor, *caches: Tensor) -> tuple[Tensor, ...]:
        m, c = self.model, self.model.config
        w, length = tokens.shape[0], caches[0].shape[2]
        groups = c.num_heads // c.num_kv_heads
        cos = self.cos.index_select(0, positions).to(self.dtype)[:, None]  # [W, 1, hd]
        sin = self.sin.index_select(0, positions).to(self.dtype)[:, None]
        seen = torch.arange(length, device=positions.device)[None, :] < positions[:, None]  # [W, L]
        bias = torch.zeros(w, length, dtype=torch.float32, device=positions.device)
        bias = bias.masked_fill(~seen, float("-inf"))
        bias = torch.cat([bias, torch.zeros(w, 1, device=positions.device)], dim=1)  # + its own key
        bias = bias.view(w, 1, 1, length + 1)
        x = m.embed_tokens(tokens).to(self.dtype)
        new: list[Tensor] = []
        for i, layer in enumerate(m.layers):
            qk, v = layer.qkv_heads(x)  # [W, H+KVH, hd], [W, KVH, hd]
            qk = apply_rope(qk, cos, sin)
            q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
            ck, cv = caches[2 * i], caches[2 * i + 1]
            k_row, v_row = k.to(ck.dtype), v.to(cv.dtype)  # what the cache will hold, rounded as it will
            new += [k_row, v_row]
            keys = torch.cat([ck.to(self.dtype), k_row.to(self.dtype)[:, :, None]], dim=2)  # [W,KVH,L+1,hd]
            vals = torch.cat([cv.to(self.dtype), v_row.to(self.dtype)[:, :, None]], dim=2)
            qg = q.reshape(w, c.num_kv_heads, groups, c.head_dim)
            scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * c.head_dim**-0.5  # [W,KVH,G,L+1]
            probs = torch.softmax(scores + bias, dim=-1).to(self.dtype)
            o = torch.matmul(probs, vals)  # [W, KVH, G, hd]
            x = layer.finish(x, o.reshape(w, -1))
        return (m._logits(x), *new)

    @staticmethod
    def write_back(cache: object, outs: tuple[Tensor, ...], slots: Tensor, positions: Tensor) -> Tensor:
        """Store the step's new K/V rows of `slots` at their positions in a KVCache; its logits."""
        rows = outs[1:]
        for i in range(len(rows) // 2):
            cache.k[i][slots, :, positions] = rows[2 * i][slots]  # type: ignore[attr-defined]
            cache.v[i][slots, :, positions] = rows[2 * i + 1][slots]  # type: ignore[attr-defined]
        return outs[0][slots]
