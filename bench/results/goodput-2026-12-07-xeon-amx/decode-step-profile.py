"""A bare decode step of SmolLM2 in bf16 at position 300 on this host: min and median of 20 steps at
THREADS threads and ROWS rows, and with a third argument a torch profile of 5 steps (by self CPU time).

    .venv/bin/python bench/results/goodput-2026-12-07-xeon-amx/decode-step-profile.py THREADS ROWS [profile]
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from rngd_pd.model import KVCache, load_model

threads, rows = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(threads)
lm = load_model(None, dtype=torch.bfloat16, progress=False)
m, c = lm.model, lm.config
cache = KVCache(c, 16, 2048, torch.bfloat16)
m.prepare_decode()
toks = torch.tensor([100 + i for i in range(rows)])
pos, slots = torch.tensor([300] * rows), torch.arange(rows)
with torch.inference_mode():
    for _ in range(5):
        m.decode_step(toks, pos, cache, slots)
    ts = []
    for _ in range(20):
        t = time.perf_counter()
        m.decode_step(toks, pos, cache, slots)
        ts.append(time.perf_counter() - t)
    print(f"threads {threads} rows {rows}: step min {min(ts) * 1000:.1f} ms "
          f"median {sorted(ts)[10] * 1000:.1f} ms")
    if len(sys.argv) > 3:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                m.decode_step(toks, pos, cache, slots)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
