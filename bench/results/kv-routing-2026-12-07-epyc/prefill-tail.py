"""In-process prefill cost of a 140-token tail after a cached prefix against the whole prompt, bf16, one
thread (docs/kv-events.md, "Routing measured"). Run from the repository root:
.venv/bin/python bench/results/kv-routing-2026-12-07-epyc/prefill-tail.py"""

import sys
import time

import numpy as np
import torch

sys.path.insert(0, ".")
from rngd_pd.engine.prefill import PrefillEngine
from rngd_pd.model.sampling import SamplingParams
from rngd_pd.model.weights import load_model

torch.set_num_threads(1)
engine = PrefillEngine(load_model(None, dtype=torch.bfloat16, progress=False), "bf16", 512,
                       prefix_cache_bytes=512 << 20)
rng = np.random.default_rng(0)
params = SamplingParams(max_tokens=1)


def timed(ids: list[int], key: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    result = engine.prefill(key, ids, params)
    return (time.perf_counter() - t0) * 1000, result.cached_tokens


print("total  cached  tail-140 ms (5 runs)            whole prompt ms (3 runs)")
for total in (300, 600, 1000):
    base = rng.integers(100, 40000, size=total).tolist()
    timed(base[:total - 140], "prefix")
    tails = [timed(base[:total - 140] + rng.integers(100, 40000, size=140).tolist(), f"t{i}")
             for i in range(5)]
    whole = [timed(rng.integers(100, 40000, size=total).tolist(), f"w{i}")[0] for i in range(3)]
    print(f"{total:5d}  {tails[0][1]:6d}  {[round(ms) for ms, _ in tails]}  {[round(ms) for ms in whole]}")
