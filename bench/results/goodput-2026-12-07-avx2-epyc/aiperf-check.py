"""The aiperf point beside the load generator's at the same rate: realized rate, mix, per-length medians."""
import json
import statistics as st
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from bench import goodput

run = Path(__file__).resolve().parent / "mix"
obj = goodput.Objective()
relaxed = goodput.Objective(2000, 4, 150)
for system in ("pd", "vllm"):
    aip, _ = goodput.aiperf_results(run / f"aiperf-{system}")
    points = map(json.loads, (run / "points.jsonl").read_text().splitlines())
    lg = next([goodput.load_gen.Result(**r) for r in d["results"]] for d in points
              if d["system"] == system and abs(d["rate"] - 0.3) < 1e-6)
    for client, rs in (("aiperf", aip), ("load_gen", lg)):
        starts = sorted(r.start_s for r in rs)
        print(f"{system:>4} {client:>8}: realized {(len(rs) - 1) / (starts[-1] - starts[0]):.3f} req/s, "
              f"mix {dict(sorted(Counter(r.prompt_tokens for r in rs).items()))}, "
              f"within strict {sum(obj.met(r) for r in rs) / len(rs):.2f}, "
              f"relaxed {sum(relaxed.met(r) for r in rs) / len(rs):.2f}")
        for n in (128, 512, 1536):
            sub = [r for r in rs if r.prompt_tokens == n]
            print(f"      {n:>5} tokens: TTFT p50 {st.median(r.ttft_ms for r in sub):7.0f} ms, TPOT p50 "
                  f"{st.median(r.tpot_ms for r in sub):5.1f} ms")
