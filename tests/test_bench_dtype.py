"""bench/dtype_default.py and the model copies it serves (bench/pd_overhead.model_copy): every copy is a
valid Triton config with the parameters set, and each pd copy is wired to its own dtype's pair."""

from __future__ import annotations

from pathlib import Path

from bench import dtype_default as D
from bench.pd_overhead import model_copy
from rngd_pd.wire.tensors import load_config


def params(config: Path) -> dict[str, str]:
    return {k: v.string_value for k, v in load_config(config).parameters.items()}


def test_model_copy_changes_a_parameter_and_adds_a_missing_one(tmp_path: Path) -> None:
    model_copy(tmp_path, "decode", "decode_x", dtype="fp32", num_slots="3")
    for config in (tmp_path / "decode_x" / "config.pbtxt", tmp_path / "decode_x" / "configs" / "cpu.pbtxt"):
        cfg = load_config(config)
        assert cfg.name == "decode_x"
        p = params(config)
        assert (p["dtype"], p["num_slots"]) == ("fp32", "3")
        assert p["kv_transport"] == "shm"  # the rest kept
    assert (tmp_path / "decode_x" / "1" / "model.py").resolve().read_text().startswith('"""')


def test_dtype_repo_wires_each_pd_to_its_own_dtype(tmp_path: Path) -> None:
    D.build_repo(tmp_path, D.DTYPES)
    for d in D.DTYPES:
        assert params(tmp_path / f"prefill_{d}" / "configs" / "cpu.pbtxt")["dtype"] == d
        assert params(tmp_path / f"decode_{d}" / "configs" / "cpu.pbtxt")["dtype"] == d
        p = params(tmp_path / f"pd_{d}" / "config.pbtxt")
        assert (p["prefill_model"], p["decode_model"]) == (f"prefill_{d}", f"decode_{d}")


def test_chosen_reads_the_instance_log_line() -> None:
    log = ('I1202 13:59:48.637363 13649 pbutils.py:202] "prefill_bf16_0_0: compute dtype bf16 (forced by '
           'the dtype parameter)"\n'
           "I1202 x serving.py] prefill_bf16_0_0: compute dtype bf16 (forced by parameter dtype)\n"
           "I1202 x serving.py] decode_auto_0_0: compute dtype fp32 (auto (decode, measured): fp32 wins)\n")
    assert D.chosen(log, "prefill_bf16").startswith("bf16 (forced")
    assert D.chosen(log, "decode_auto").startswith("fp32 (auto")
    assert D.chosen(log, "decode_fp32") == "?"
