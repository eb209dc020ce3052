"""bench/kpi.py and bench/power.py: FLOP counts, MFU, card parsing, power readers (no servers)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench import kpi, power
from rngd_pd.errors import ConfigError


@dataclass(frozen=True)
class Shape:
    """SmolLM2-135M's shape (the fields kpi needs)."""

    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64


SMOL = Shape()


def test_matmul_params_of_smollm2_count_every_projection_and_the_lm_head() -> None:
    per_layer = 576 * 576 + 2 * 576 * 192 + 576 * 576 + 3 * 576 * 1536
    assert kpi.matmul_params(SMOL) == 30 * per_layer + 576 * 49152
    # ~134.5M: the 135M model minus nothing (tied embeddings count once, as the LM head)
    assert 134e6 < kpi.matmul_params(SMOL) < 135e6


def test_flops_per_token_adds_attention_linear_in_context() -> None:
    f0 = kpi.flops_per_token(SMOL, 0)
    assert f0 == 2 * kpi.matmul_params(SMOL)
    assert kpi.flops_per_token(SMOL, 1000) - f0 == pytest.approx(4 * 30 * 9 * 64 * 1000)


def test_request_flops_is_prefill_plus_decode() -> None:
    only_prompt = kpi.request_flops(SMOL, 512, 0)
    assert only_prompt == pytest.approx(512 * kpi.flops_per_token(SMOL, 256))
    both = kpi.request_flops(SMOL, 512, 128)
    assert both - only_prompt == pytest.approx(128 * kpi.flops_per_token(SMOL, 512 + 64))


def test_mfu_counts_whole_requests_when_lengths_are_known() -> None:
    row = {"output_tok_s": 128.0, "mean_prompt_tokens": 512, "mean_output_tokens": 128}
    k = kpi.kpis(row, SMOL, peak_tflops_total=1.0)
    # 128 tok/s of 128-token requests = 1 request/s
    assert k["model_tflops"] == pytest.approx(kpi.request_flops(SMOL, 512, 128) / 1e12)
    assert k["mfu"] == pytest.approx(k["model_tflops"] / 1.0)
    assert k["power_w"] is None and "not measured" in k["power_source"]


def test_mfu_from_tokens_only_uses_flops_per_token() -> None:
    k = kpi.kpis({"tok_s": 10.0}, SMOL, peak_tflops_total=2.0)
    assert k["mfu"] == pytest.approx(10 * kpi.flops_per_token(SMOL, 0) / 2e12)


def test_power_fields_give_tokens_per_joule() -> None:
    r = power.PowerReading(watts=50.0, joules=500.0, seconds=10.0, note="RAPL intel-rapl:0")
    assert kpi.power_fields(r, tok_s=100.0) == {"power_w": 50.0, "tok_per_j": 2.0, "power_source": r.note}
    unreadable = power.PowerReading(None, None, 1.0, "not readable: no RAPL")
    assert kpi.power_fields(unreadable, 100.0)["power_source"] == "not readable: no RAPL"


def test_parse_cards_dedups_and_rejects_unknown_devices() -> None:
    assert kpi.parse_cards("rngd:0, atom:1") == [kpi.Card("rngd", 0), kpi.Card("atom", 1)]
    assert kpi.parse_cards("cpu:0,cpu:0") == [kpi.Card("cpu", 0)]
    with pytest.raises(ConfigError, match="unknown device 'gpu'"):
        kpi.parse_cards("gpu:0")
    with pytest.raises(ConfigError, match="no cards"):
        kpi.parse_cards(" , ")


def test_total_peak_sums_spec_sheet_cards_and_honours_the_override() -> None:
    total, peaks = kpi.total_peak(kpi.parse_cards("rngd:0,rngd:1,atom:0"))
    assert total == 256.0 * 2 + 32.0
    assert [p.dtype for p in peaks] == ["bf16", "bf16", "fp16"]
    assert kpi.total_peak(kpi.parse_cards("cpu:0"), peak_tflops=0.5)[0] == 0.5


def test_measure_cpu_tflops_is_positive() -> None:
    assert kpi.measure_cpu_tflops(seconds=0.05, n=128) > 0


def test_read_rows_skips_non_json_lines() -> None:
    lines = ["table header", json.dumps({"tok_s": 1.0}), "{broken", json.dumps([1, 2])]
    assert kpi.read_rows(lines) == [{"tok_s": 1.0}]


def test_field_aliases_and_non_numbers() -> None:
    assert kpi.field({"output_tokens_per_s": 3}, "output_tok_s") == 3.0
    assert kpi.field({"output_tok_s": True}, "output_tok_s") is None
    assert kpi.field({}, "duration_s") is None


def test_parse_furiosa_smi_info_table() -> None:
    text = """
+------+--------+------------------+---------+---------+--------------+
| Arch | Device | Firmware         | Temp.   | Power   | PCI-BDF      |
+------+--------+------------------+---------+---------+--------------+
| rngd | npu0   | 1.7.0, 4dfed185  | 40.98°C | 38.40 W | 0000:03:00.0 |
| rngd | npu1   | 1.7.0, 4dfed185  | 41.34°C |  37 W   | 0000:04:00.0 |
+------+--------+------------------+---------+---------+--------------+"""
    assert power.parse_furiosa_smi(text) == {0: 38.4, 1: 37.0}


def test_parse_rbln_stat_json_and_table() -> None:
    js = json.dumps(
        {
            "devices": [
                {"npu": 0, "name": "RBLN-CA12", "card_power": "41.5W"},
                {"npu": "1", "name": "RBLN-CA12", "card_power": "40W"},
            ]
        }
    )
    assert power.parse_rbln_stat(js) == {0: 41.5, 1: 40.0}
    table = "| 0 | RBLN-CA12 | 0000:3b:00.0 | 45C | 52.1W | 1.2G / 16G | 12% |"
    assert power.parse_rbln_stat(table) == {0: 52.1}


def _rapl(root: Path, idx: int, uj: int, max_uj: int = 1000_000_000) -> Path:
    d = root / f"intel-rapl:{idx}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "energy_uj").write_text(f"{uj}\n")
    (d / "max_energy_range_uj").write_text(f"{max_uj}\n")
    return d


def test_rapl_meter_integrates_energy_and_handles_wraparound(tmp_path: Path) -> None:
    d = _rapl(tmp_path, 0, 999_000_000)
    domains, why = power.rapl_domains([0], root=tmp_path)
    assert domains == [d] and why == ""
    m = power.RaplMeter(domains)
    m.start()
    (d / "energy_uj").write_text("1000000\n")  # wrapped: +1 J to the top, +1 J after
    r = m.stop()
    assert r.joules == pytest.approx(2.0)
    assert r.watts is not None and r.watts > 0 and "intel-rapl:0" in r.note


def test_rapl_missing_is_reported_not_guessed(tmp_path: Path) -> None:
    domains, why = power.rapl_domains([0], root=tmp_path)
    assert domains == [] and "does not exist" in why


def test_open_meter_without_tools_says_why(monkeypatch) -> None:
    monkeypatch.setattr(power.shutil, "which", lambda tool: None)  # no vendor tool, wherever this runs
    m = power.open_meter([kpi.Card("atom", 0)])
    assert isinstance(m, power.Unreadable)
    m.start()
    r = m.stop()
    assert r.watts is None and "rbln-stat is not installed" in r.note


class _Fixed:
    def __init__(self, w: float | None) -> None:
        self.w = w

    def start(self) -> None:
        pass

    def stop(self) -> power.PowerReading:
        return power.PowerReading(self.w, None, 2.0, f"fixed {self.w}")


def test_sum_meter_sums_cards_and_refuses_a_partial_sum() -> None:
    assert power.SumMeter([_Fixed(10.0), _Fixed(5.0)]).stop().watts == 15.0
    partial = power.SumMeter([_Fixed(10.0), _Fixed(None)]).stop()
    assert partial.watts is None and "fixed None" in partial.note


def test_sampled_meter_averages_samples(tmp_path: Path) -> None:
    script = tmp_path / "smi.sh"
    script.write_text(
        "#!/bin/sh\necho '| rngd | npu0 | fw | 40C | 30.00 W | x |'\n"
        "echo '| rngd | npu1 | fw | 40C | 20.00 W | x |'\n"
    )
    script.chmod(0o755)
    m = power.SampledMeter([str(script)], power.parse_furiosa_smi, [0, 1], interval=0.01)
    m.start()
    r = m.stop()
    assert r.watts == pytest.approx(50.0) and "samples" in r.note
    missing = power.SampledMeter([str(script)], power.parse_furiosa_smi, [2], interval=0.01)
    missing.start()
    assert "no power for card(s) [2]" in missing.stop().note
