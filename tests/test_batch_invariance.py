"""Batch invariance of decode: a request's per-step logits (so its greedy tokens) are bit-identical
alone and in batches of any size with other ragged requests, in fp32 and bf16 compute (the
soak benchmark's "0 mismatches with --dtype fp32"; rngd_pd.model.llama's docstring says how)."""

from __future__ import annotations

import dataclasses
import threading
import types

import pytest
import torch

from rngd_pd.engine.decode import DecodeEngine
from rngd_pd.engine.prefill import PrefillEngine
from rngd_pd.engine.request import DecodeRequest
from rngd_pd.model import KVCache
from rngd_pd.model import llama as llama_mod
from rngd_pd.model.llama import Llama
from rngd_pd.model.sampling import SamplingParams

BF16 = torch.bfloat16
TEXT = ("the game of go is played on a board of nineteen lines where two players place black and white "
         "stones in turn and try to surround more territory than the other")
WORDS = TEXT.split(" ")
STEPS = 12


def _prompt(tokenizer, n_words: int, offset: int) -> list[int]:
    return tokenizer.encode(" ".join(WORDS[(offset + i) % len(WORDS)] for i in range(n_words)))


@pytest.fixture(scope="module")
def models(smollm) -> dict[str, Llama]:
    """The embedded model in fp32 (the session fixture) and in bf16 compute (a copy of its weights)."""
    bf16 = Llama(smollm.config, BF16)
    bf16.load_state_dict(smollm.model.state_dict())
    bf16.eval().prepare_decode()
    smollm.model.prepare_decode()
    return {"fp32": smollm.model, "bf16": bf16}


Row = tuple[list[int], int, int]  # prompt, first step in the batch, step after its last


def _trace(
    model: Llama, target: list[int], others: list[Row], slot: int, slots: int, max_len: int
) -> torch.Tensor:
    """The target's logits [STEPS, V] decoded greedily in `slot`, the other rows joining and leaving
    the batch at their steps (so the batch size changes under the target)."""
    cache = KVCache(model.config, slots, max_len, BF16)
    free = [s for s in range(slots) if s != slot]
    rows = [(target, 0, STEPS, slot)] + [(p, a, e, free[i]) for i, (p, a, e) in enumerate(others)]
    state = {}
    for p, _, _, s in rows:
        logits, kv = model.prefill(torch.tensor(p), kv_dtype=BF16)
        cache.load_all(s, kv)
        state[s] = (int(logits.argmax()), len(p))
    out = []
    for step in range(STEPS):
        active = sorted(s for _, a, e, s in rows if a <= step < e)
        tokens = torch.tensor([state[s][0] for s in active])
        positions = torch.tensor([state[s][1] for s in active])
        logits = model.decode_step(tokens, positions, cache, torch.tensor(active))
        for i, s in enumerate(active):
            state[s] = (int(logits[i].argmax()), state[s][1] + 1)
        out.append(logits[active.index(slot)].clone())
    return torch.stack(out)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_step_logits_are_bit_identical_alone_and_in_ragged_batches(models, smollm, dtype) -> None:
    model, tok = models[dtype], smollm.tokenizer
    for target_words in (3, 12):  # ~5 and ~15 tokens: lengths below and across a 16-key block
        target = _prompt(tok, target_words, 0)
        alone = _trace(model, target, [], 0, 1, len(target) + STEPS)
        batches = {
            "one longer": ([(_prompt(tok, 30, 3), 0, STEPS)], 0, 4, 96),
            "two, one leaves": ([(_prompt(tok, 2, 5), 0, 5), (_prompt(tok, 20, 1), 0, STEPS)], 1, 3, 64),
            "four joining late": ([(_prompt(tok, 4 + 9 * i, i), 2 + i, STEPS) for i in range(4)], 4, 5, 80),
            "seven ragged": ([(_prompt(tok, 2 + 7 * i, i), i % 3, STEPS - i) for i in range(7)], 7, 8, 128),
            "big bucket": ([(_prompt(tok, 50, 2), 0, STEPS)], 1, 2, 2048),
            "long rows attend apart": ([(_prompt(tok, 300, 2), 0, STEPS), (_prompt(tok, 140, 4), 0, STEPS)],
                                       2, 3, 1024),
        }
        for name, (others, slot, slots, max_len) in batches.items():
            got = _trace(model, target, others, slot, slots, max_len)
            same = [bool(torch.equal(a, b)) for a, b in zip(alone, got, strict=True)]
            assert all(same), f"{dtype} target of {len(target)} tokens, {name}: steps {same}"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_engine_greedy_and_logits_alone_equal_continuous_batching(models, smollm, monkeypatch, dtype) -> None:
    """Through DecodeEngine: 8 ragged requests in 8 slots (two buckets, finishing at different
    steps) against each alone in a one-slot engine; every step's logits and every token equal."""
    loaded = dataclasses.replace(smollm, model=models[dtype])
    tok = smollm.tokenizer
    prompts = [_prompt(tok, 2 + 6 * i, i) for i in range(8)]
    params = [SamplingParams(max_tokens=4 + i % 5, ignore_eos=True) for i in range(8)]
    pre = PrefillEngine(loaded, chunk_size=None)
    results = [pre.prefill(f"p{i}", p, params[i]) for i, p in enumerate(prompts)]
    seen: dict[tuple[int, int, int], torch.Tensor] = {}  # (cache, slot, position) -> logits row
    real_step = loaded.model.decode_step_parts

    def recording_step(tokens, positions, parts):
        out = real_step(tokens, positions, parts)
        where = [(id(cache), s) for cache, slots in parts for s in slots.tolist()]
        for i, ((c, s), p) in enumerate(zip(where, positions.tolist(), strict=True)):
            seen[(c, s, p)] = out[i].clone()
        return out

    monkeypatch.setattr(loaded.model, "decode_step_parts", recording_step)

    def run(indices: list[int], num_slots: int) -> dict[int, tuple[list[int], list[torch.Tensor]]]:
        seen.clear()
        where: dict[int, tuple[int, int]] = {}
        tokens: dict[int, list[int]] = {i: [] for i in indices}
        done = {i: threading.Event() for i in indices}
        with DecodeEngine(loaded, num_slots=num_slots, max_len=160, buckets=[40, 160]) as eng:
            for i in indices:
                res = results[i]

                def load(cache, slot, i=i, res=res):
                    where[i] = (id(cache), slot)
                    cache.load_all(slot, res.kv)

                def emit(ev, i=i):
                    if ev.token_id is not None:
                        tokens[i].append(ev.token_id)
                    if ev.finished:
                        done[i].set()

                eng.submit(DecodeRequest(f"r{i}", res.num_tokens, res.first_token, params[i], load, emit))
            for ev in done.values():
                assert ev.wait(120)
        n = {i: results[i].num_tokens for i in indices}
        return {i: (tokens[i], [seen[(*where[i], p)] for p in range(n[i], n[i] + len(tokens[i]) - 1)])
                for i in indices}  # fmt: skip

    together = run(list(range(8)), 8)
    for i in range(8):
        (alone_tokens, alone_logits), (tokens, logits) = run([i], 1)[i], together[i]
        assert tokens == alone_tokens, f"request {i}"
        assert len(logits) == params[i].max_tokens - 1
        assert all(torch.equal(a, b) for a, b in zip(alone_logits, logits, strict=True)), f"request {i}"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_step_over_several_caches_gives_each_row_its_own_caches_bits(models, smollm, dtype) -> None:
    """decode_step_parts (one step over the rows of every bucket) against decode_step over each
    cache alone: the same logits bits for every row, for several steps, and the same K/V written."""
    model, tok = models[dtype], smollm.tokenizer
    shapes = ((3, 48), (2, 160), (1, 512))  # (rows, max_len) per cache: three buckets
    prompts = [[_prompt(tok, 3 + 11 * i + 5 * j, i + j) for j in range(rows)]
               for i, (rows, _) in enumerate(shapes)]

    def caches() -> tuple[list[KVCache], list[int], list[int]]:
        """One cache per shape, its prompts prefilled into slots 1.. (a part's slots are no plain
        range from 0); the first tokens and the positions, flat in part order."""
        out, toks, pos = [], [], []
        for (rows, max_len), group in zip(shapes, prompts, strict=True):
            cache = KVCache(model.config, rows + 1, max_len, BF16)
            for slot, prompt in enumerate(group, start=1):
                logits, kv = model.prefill(torch.tensor(prompt), kv_dtype=BF16)
                cache.load_all(slot, kv)
                toks.append(int(logits.argmax()))
                pos.append(len(prompt))
            out.append(cache)
        return out, toks, pos

    fused, toks, pos = caches()
    alone, _, _ = caches()
    slots = [torch.arange(1, rows + 1) for rows, _ in shapes]
    for step in range(4):
        parts = list(zip(fused, slots, strict=True))
        got = model.decode_step_parts(torch.tensor(toks), torch.tensor(pos), parts)
        want, start = [], 0
        for cache, s in zip(alone, slots, strict=True):
            n = len(s)
            want.append(model.decode_step(torch.tensor(toks[start : start + n]),
                                          torch.tensor(pos[start : start + n]), cache, s))
            start += n
        assert torch.equal(got, torch.cat(want)), f"{dtype} step {step}"
        toks, pos = got.argmax(dim=-1).tolist(), [p + 1 for p in pos]
    for c_f, c_a in zip(fused, alone, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(c_f.k + c_f.v, c_a.k + c_a.v, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_decode_attention_gives_a_row_its_bits_alone_and_beside_longer_rows(dtype) -> None:
    """The step's SDPA attention at the lengths the model's traces do not reach: a row alone over its
    own keys rounded up to 16, and in a step of up to 16 rows whose longest has up to 1,500 keys (past
    the kernel's 512-key blocks), in scattered or consecutive slots, on 1 and 2 threads: the same bits."""
    gen = torch.Generator().manual_seed(0)
    kvh, g, hd, slots, max_len = 3, 3, 64, 16, 1600
    ck = torch.randn(slots, kvh, max_len, hd, generator=gen).to(dtype)
    cv = torch.randn(slots, kvh, max_len, hd, generator=gen).to(dtype)

    cache = types.SimpleNamespace(num_slots=slots, max_len=max_len)

    def attend(q, where, pos):  # what the step runs: one SDPA per run of consecutive slots
        group = llama_mod._AttnGroup(cache, None, where, pos, torch.tensor(pos), torch.device("cpu"))
        return llama_mod._attend_runs(ck, cv, group, q, dtype, hd**-0.5)

    threads = torch.get_num_threads()
    try:
        for trial, n in enumerate((2, 3, 5, 8, 11, 16)):
            pos = torch.randint(0, (40, 300, 700, 1500)[trial % 4], (n,), generator=gen).tolist()
            pos[0] = (500, 1100, 1499)[trial % 3]  # one long row in every step
            q = torch.randn(n, kvh, g, hd, generator=gen).to(dtype)
            scattered = torch.randperm(slots, generator=gen)[:n].tolist()
            for where in (scattered, list(range(n))):
                torch.set_num_threads(1 + trial % 2)
                together = attend(q, where, pos)
                torch.set_num_threads(2 - trial % 2)
                for i in range(n):
                    alone = attend(q[i : i + 1], [where[i]], [pos[i]])
                    assert torch.equal(alone[0], together[i]), f"{dtype} rows {n} row {i} at {pos[i]} keys"
    finally:
        torch.set_num_threads(threads)


def test_rows_attend_in_groups_by_length_only_where_it_saves_keys() -> None:
    groups = llama_mod._length_groups
    assert groups([10, 200, 230]) == [None]  # under _SPLIT_KEYS keys: one group
    assert groups([300, 400, 500]) == [None]  # every row over half the longest
    assert groups([1600, 100, 700, 1500, 20]) == [[0, 3], [2], [1, 4]]  # 1600s, 700, the short ones
    assert groups([600, 30]) == [[0], [1]]


def test_min_rows_are_measured_and_attention_lengths_rounded(models) -> None:
    for model in models.values():
        assert model.decode_invariant
        assert all(1 < m <= llama_mod._CHECK_ROWS for m in model.decode_rows.values())
    assert [llama_mod._attention_length(n) for n in (1, 15, 16, 17, 57)] == [16, 16, 16, 32, 64]


def test_min_rows_finds_the_row_counts_a_kernel_treats_differently(models, monkeypatch) -> None:
    """_min_rows against fake kernels: one that changes below 3 rows, one that changes by position."""
    model = models["fp32"]
    real = llama_mod._linear

    def below_three(x, w, packed, name, rows=None):
        y = real(x, w, packed, name, rows)
        return y.nextafter(torch.full_like(y, float("inf"))) if x.shape[0] < 3 and name == "w2" else y

    monkeypatch.setattr(llama_mod, "_linear", below_three)
    rows, ok = model._min_rows()
    assert ok and rows["w2"] == 3 and all(rows.get(n, 1) <= 2 for n in ("wqkv", "wo", "w13", "lm_head"))

    def by_position(x, w, packed, name, rows=None):
        y = real(x, w, packed, name, rows)
        if name == "lm_head" and x.shape[0] > 1:
            y[-1] = y[-1].nextafter(torch.full_like(y[-1], float("inf")))
        return y

    monkeypatch.setattr(llama_mod, "_linear", by_position)
    assert model._min_rows() == ({}, False)
