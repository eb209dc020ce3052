"""bench/peers/vllm.py, bench/peers/aiperf.py and the issue-13 parts of the sweep, without vLLM or aiperf.

Command lines, environment and dtype choice are checked as built; the HF-format copy of the embedded
GGUF is written and loaded with transformers, whose greedy tokens must equal transformers' on the
GGUF itself; the issue-13 ratios and the aiperf table run on synthetic rows.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from bench import sweep, sweep_report
from bench.peers import aiperf, vllm

# ----------------------------------------------------------------------------- vLLM command line


def test_vllm_server_argv_runs_the_openai_server_from_its_venv(tmp_path: Path) -> None:
    argv = vllm.server_argv(tmp_path / "m", 9300, dtype="bfloat16", max_model_len=4096, venv=tmp_path / "v")
    assert argv[:3] == [str(tmp_path / "v" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    val = {k: argv[argv.index(k) + 1] for k in ("--model", "--dtype", "--max-model-len", "--port", "--host")}
    assert val == {
        "--model": str(tmp_path / "m"),
        "--dtype": "bfloat16",
        "--max-model-len": "4096",
        "--port": "9300",
        "--host": "127.0.0.1",
    }
    assert argv[argv.index("--served-model-name") + 1] == vllm.SERVED_NAME
    assert not vllm.installed(tmp_path / "v")


def test_vllm_env_sizes_kv_cache_and_threads_for_two_cores() -> None:
    env = vllm.server_env(2, 3)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["OMP_NUM_THREADS"] == "2"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["HF_HUB_OFFLINE"] == "1"
    assert vllm.server_env(1, 1)["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert vllm.server_env(2, 1, "nobind")["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


def test_vllm_install_drops_the_cuda_extras(tmp_path: Path) -> None:
    install, uninstall = vllm.install_steps(tmp_path / "v")
    assert install[:2] == ["nice", "-n"] and vllm.PACKAGE in install and "install" in install
    assert set(vllm.CUDA_EXTRAS) <= set(uninstall) and "-y" in uninstall
    assert {"torchvision", "torchaudio", "torchcodec"} == set(vllm.CUDA_EXTRAS)


def test_vllm_dtype_is_bf16_only_with_native_bf16() -> None:
    assert vllm.choose_dtype(features={"avx512f", "avx512_bf16"})[0] == "bfloat16"
    assert vllm.choose_dtype(features={"amx_bf16"})[0] == "bfloat16"
    dtype, why = vllm.choose_dtype(features={"avx2", "fma"})
    assert dtype == "float32" and "AVX2" in why
    assert vllm.choose_dtype("float32", features={"avx512_bf16"}) == ("float32", "asked for")


def _args(*argv: str) -> argparse.Namespace:
    return sweep.parse_args(list(argv))


def test_sweep_builds_vllm_command_from_its_flags(tmp_path: Path) -> None:
    a = _args(
        "--preset", "issue13", "--vllm-dtype", "float32", "--vllm-threads", "2", "--vllm-kv-cache-gib", "3"
    )
    argv, env, info = sweep.vllm_command(9301, tmp_path / "m", a)
    assert argv[argv.index("--dtype") + 1] == "float32" and info["dtype"] == "float32"
    assert argv[argv.index("--max-model-len") + 1] == "2048"  # 512 + 128 fits in the smallest size
    assert argv[argv.index("--max-num-seqs") + 1] == str(a.num_slots)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["OMP_NUM_THREADS"] == "2"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and info["bind"] == "cores"  # the default
    big = _args("--shapes", "3000x200", "--trace", "")
    assert sweep.vllm_max_model_len(big) == 4096


# ----------------------------------------------------------------------------- the sweep's points


def test_issue13_preset_runs_exactly_the_judged_points() -> None:
    a = _args("--preset", "issue13")
    assert a.systems == ["pd", "colocated", "vllm"] and a.ignore_eos and a.trace is None
    pts = [(w.name, w.concurrency, w.prompt_tokens, w.max_tokens) for w in sweep.grid(a)]
    assert pts == [(f"fixed-{p}x{o}", c, p, o) for p, o in ((256, 64), (512, 128)) for c in (1, 8, 16)]
    assert [w.requests for w in sweep.grid(a)][:3] == [6, 24, 48]  # 3 waves, at least 6
    fewer = _args("--preset", "issue13", "--waves", "1", "--min-requests", "2", "--systems", "pd,vllm")
    assert [w.requests for w in sweep.grid(fewer)][:3] == [2, 8, 16] and fewer.systems == ["pd", "vllm"]
    assert "vllm" in sweep.DEFAULT_SYSTEMS and "vllm" in sweep.ALL_SYSTEMS


def test_shapes_flag_and_its_errors() -> None:
    a = _args("--shapes", "128x16,64x8", "--concurrency", "2", "--trace", "")
    assert [(w.name, w.prompt_tokens, w.max_tokens) for w in sweep.grid(a)] == [
        ("fixed-128x16", 128, 16),
        ("fixed-64x8", 64, 8),
    ]
    with pytest.raises(SystemExit):
        _args("--shapes", "256by64")


def test_aiperf_point_matches_a_load_gen_point() -> None:
    a = _args("--preset", "issue13", "--aiperf")
    w = sweep.aiperf_point(a)
    assert (w.name, w.concurrency, w.prompt_tokens, w.max_tokens, w.requests) == (
        "fixed-256x64",
        8,
        256,
        64,
        24,
    )
    assert any((p.name, p.concurrency) == (w.name, w.concurrency) for p in sweep.grid(a))
    assert a.aiperf_systems == ["pd", "vllm"]


def test_latest_rows_keeps_aiperf_and_load_gen_rows_of_one_point(tmp_path: Path) -> None:
    path = tmp_path / "sweep.jsonl"
    base = {"system": "pd", "workload": "fixed-256x64", "concurrency": 8}
    lines = [
        {**base, "output_tok_s": 1.0, "client": "load_gen"},
        {**base, "output_tok_s": 2.0, "client": "aiperf"},
        {**base, "output_tok_s": 3.0, "client": "load_gen"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    got = {r["client"]: r["output_tok_s"] for r in sweep.latest_rows(path)}
    assert got == {"load_gen": 3.0, "aiperf": 2.0}


# ----------------------------------------------------------------------------- aiperf


def test_aiperf_profile_argv_is_a_closed_loop_of_fixed_shapes(tmp_path: Path) -> None:
    argv = aiperf.profile_argv(
        "http://127.0.0.1:9",
        "m",
        tokenizer=tmp_path / "tok",
        concurrency=8,
        requests=24,
        prompt_tokens=256,
        max_tokens=64,
        artifacts=tmp_path / "art",
        venv=tmp_path / "v",
    )
    assert argv[:2] == [str(tmp_path / "v" / "bin" / "aiperf"), "profile"]
    val = lambda k: argv[argv.index(k) + 1]  # noqa: E731
    assert (val("--endpoint-type"), val("--concurrency"), val("--request-count")) == (
        "completions",
        "8",
        "24",
    )
    assert (val("--synthetic-input-tokens-mean"), val("--synthetic-input-tokens-stddev")) == ("256", "0")
    assert (val("--output-tokens-mean"), val("--output-tokens-stddev")) == ("64", "0")
    assert "--streaming" in argv and val("--tokenizer") == str(tmp_path / "tok")
    assert "ignore_eos:true" in argv and "min_tokens:64" not in argv and "--warmup-request-count" not in argv


def test_aiperf_export_maps_onto_row_fields(tmp_path: Path) -> None:
    doc = {
        "records": {
            "output_token_throughput": {"unit": "tokens/sec", "avg": 123.456},
            "time_to_first_token": {"unit": "ms", "avg": 90.0, "p50": 80.0, "p99": 200.0},
            "inter_token_latency": {"unit": "ms", "p50": 30.0, "p99": 41.0},
            "request_count": {"avg": 24.0},
            "output_sequence_length": {"avg": 64.0},
        }
    }
    out = tmp_path / "art" / "deep"
    out.mkdir(parents=True)
    (out / aiperf.EXPORT).write_text(json.dumps(doc))
    row = aiperf.read_results(tmp_path / "art")
    assert row == {
        "output_tok_s": 123.456,
        "ttft_p50_ms": 80.0,
        "ttft_p99_ms": 200.0,
        "tpot_p50_ms": 30.0,
        "tpot_p99_ms": 41.0,
        "requests": 24,
        "mean_output_tokens": 64.0,
    }
    flat = aiperf.parse_export({"metrics": [{"tag": "output_token_throughput", "avg": 5.0}]})
    assert flat == {"output_tok_s": 5.0}
    assert aiperf.read_results(tmp_path / "nothing") is None


# ----------------------------------------------------------------------------- report


def _row(system: str, wl: str, c: int, tok: float, ttft: float, p99: float, **kw: Any) -> dict[str, Any]:
    return {
        "system": system,
        "workload": wl,
        "concurrency": c,
        "output_tok_s": tok,
        "ttft_p50_ms": ttft,
        "ttft_p99_ms": ttft * 2,
        "tpot_p50_ms": p99 / 2,
        "tpot_p99_ms": p99,
        "slo_share": 1.0,
        **kw,
    }


def _issue13_rows() -> list[dict[str, Any]]:
    rows = []
    for wl in ("fixed-256x64", "fixed-512x128"):
        for c in (1, 8, 16):
            rows.append(_row("pd", wl, c, 40.0 * c, 100.0, 30.0))
            rows.append(_row("colocated", wl, c, 30.0 * c, 120.0, 35.0))
            rows.append(_row("vllm", wl, c, 20.0 * c, 200.0, 60.0 if c == 16 else 20.0))
    rows.append(_row("pd", "fixed-256x64", 8, 300.0, 110.0, 32.0, client="aiperf"))
    rows.append(_row("vllm", "fixed-256x64", 8, 150.0, 210.0, 25.0, client="aiperf"))
    return rows


def test_issue13_ratios_and_goals() -> None:
    checks = sweep_report.issue13(_issue13_rows())
    assert len(checks) == 8  # 2 workloads x (tok/s at 8, at 16, TTFT p50 at 1, TPOT p99 at 16)
    by = {(c["workload"], c["metric"], c["concurrency"]): c for c in checks}
    tok8 = by[("fixed-256x64", "output_tok_s", 8)]
    assert (tok8["pd"], tok8["vllm"], tok8["colocated"], tok8["ratio"], tok8["met"]) == (
        320.0,
        160.0,
        240.0,
        2.0,
        True,
    )
    ttft = by[("fixed-512x128", "ttft_p50_ms", 1)]
    assert ttft["ratio"] == 0.5 and ttft["met"] is True and ttft["goal"] == "<= 1"
    assert by[("fixed-256x64", "tpot_p99_ms", 16)]["ratio"] == 0.5
    slow = [
        r if r["system"] != "vllm" else {**r, "output_tok_s": r["output_tok_s"] * 2} for r in _issue13_rows()
    ]
    assert sweep_report.issue13(slow)[0]["met"] is False  # 320 / 320 < 1.5
    missing = sweep_report.issue13([r for r in _issue13_rows() if r["system"] != "vllm"])
    assert all(c["met"] is None for c in missing)


def test_report_prints_issue13_and_aiperf_tables_and_json_has_them() -> None:
    rows = _issue13_rows()
    text = sweep_report.report(rows)
    assert "issue 13: PD against vLLM CPU" in text and "PD/vLLM CPU" in text
    assert "aiperf/load_gen" in text and "ttft_p50_ms side by side" in text
    main_table = text.split("\n\n")[0]
    assert "300" not in main_table  # aiperf rows stay out of the load generator's tables
    summary = sweep_report.summary(rows)
    assert {c["ratio"] for c in summary["issue13"] if c["metric"] == "output_tok_s"} == {2.0}
    pd_ai = next(e for e in summary["aiperf"] if e["system"] == "pd")
    assert pd_ai["output_tok_s"] == {"aiperf": 300.0, "load_gen": 320.0, "ratio": 0.938}
    json.dumps(summary)  # report.json is plain JSON


def test_plot_has_a_panel_per_shape(tmp_path: Path) -> None:
    path = sweep_report.plot(_issue13_rows(), tmp_path / "sweep.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import struct

    width, height = struct.unpack(">II", data[16:24])
    assert width > 1.8 * height  # two panels side by side


# ----------------------------------------------------------------------------- the HF copy


@pytest.fixture(scope="module")
def gguf() -> Path:
    from bench.peers.hf_server import embedded_gguf

    return embedded_gguf()  # the embedded model package is part of `make setup`


@pytest.mark.slow
@pytest.mark.long
def test_hf_copy_loads_with_transformers_and_gives_the_ggufs_greedy_tokens(
    tmp_path: Path, gguf: Path
) -> None:
    out = vllm.write_hf_copy(gguf, tmp_path / "hf")
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    ids = tok.encode("The capital of France is", add_special_tokens=False)
    assert ids and max(ids) < cfg["vocab_size"]
    assert vllm.greedy_tokens(out, ids, 6) == vllm.greedy_tokens(None, ids, 6, gguf=gguf)
    again = vllm.write_hf_copy(gguf, out)  # reused while the source stamp matches
    assert again == out and (out / "SOURCE").read_text().endswith(str(gguf.stat().st_size))


def test_aiperf_is_compared_with_the_load_gen_run_paired_with_it() -> None:
    rows = _issue13_rows()
    paired = _row("pd", "fixed-256x64", 8, 280.0, 105.0, 31.0, client="load_gen-paired", loadavg_1m=3.5)
    summary = sweep_report.summary([*rows, paired])
    pd_ai = next(e for e in summary["aiperf"] if e["system"] == "pd")
    assert pd_ai["load_gen_row"] == "load_gen-paired" and pd_ai["output_tok_s"]["load_gen"] == 280.0
    assert pd_ai["loadavg_1m"]["load_gen"] == 3.5
    grid = {(r["system"], r["concurrency"], r["output_tok_s"]) for r in sweep_report.served([*rows, paired])}
    assert ("pd", 8, 280.0) not in grid  # the paired run stays out of the grid's tables
    assert "load_1m" in sweep_report.report([*rows, paired])


def test_every_point_sends_new_prompts_but_every_system_the_same() -> None:
    a = _args("--preset", "issue13", "--aiperf")
    pts = sweep.grid(a)
    seeds = [sweep.prompt_seed(w) for w in pts]
    assert len(set(seeds)) == len(seeds)  # no point resends another's prompts (prefix caches)
    assert sweep.prompt_seed(sweep.aiperf_point(a), "load_gen-paired") not in seeds
    pd = sweep.load_gen_argv(sweep.Target("pd", "http://a"), pts[0], a)
    vl = sweep.load_gen_argv(sweep.Target("vllm", "http://b"), pts[0], a)
    assert pd[pd.index("--seed") + 1] == vl[vl.index("--seed") + 1] == str(seeds[0])
