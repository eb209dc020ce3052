"""bench/decode_attention.py: both decode attentions agree on every shape it times; it writes its table."""

from __future__ import annotations

import json

from bench import decode_attention


def test_sdpa_and_matmuls_agree_and_the_bench_reports_both(tmp_path, capsys):
    out = tmp_path / "attn.json"
    argv = ["--dtype", "fp32", "--threads", "1", "--repeat", "1", "--json", str(out)]
    assert decode_attention.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["rows"], r["keys"]) for r in rows] == [(n, k) for n in decode_attention.LAYOUTS
                                                      for k in decode_attention.KEYS]
    assert all(r["max_abs_diff"] < 1e-5 and r["sdpa_ms"] > 0 and r["matmuls_ms"] > 0 for r in rows)
    assert "| fp32 | 1 | 8 rows, 2 runs | 1600 |" in capsys.readouterr().out
