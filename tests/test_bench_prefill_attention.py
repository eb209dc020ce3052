"""bench/prefill_attention.py: both attentions agree on every shape it times, and it writes its table."""

from __future__ import annotations

import json

from bench import prefill_attention


def test_sdpa_and_query_blocks_agree_and_the_bench_reports_both(tmp_path, capsys):
    out = tmp_path / "attn.json"
    argv = ["--dtype", "fp32", "--threads", "1", "--repeat", "1", "--json", str(out)]
    assert prefill_attention.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["past"], r["new"]) for r in rows] == list(prefill_attention.SHAPES)
    assert all(r["max_abs_diff"] < 1e-4 and r["sdpa_ms"] > 0 and r["blocks_ms"] > 0 for r in rows)
    assert "| fp32 | 1 | 1024 | 512 |" in capsys.readouterr().out
