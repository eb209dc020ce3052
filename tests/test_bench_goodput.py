"""bench/goodput.py without servers: workloads, the objective, goodput and bisection, table and plot."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from dataclasses import asdict

import pytest

from bench import goodput, load_gen


def _words(n: int) -> str:
    return "".join(f" w{i}" for i in range(n))


def _counter_maker():
    counter = itertools.count()
    return lambda n: "".join(f" t{next(counter)}" for _ in range(n))


def test_mix_is_normalised_and_checked():
    assert goodput.parse_mix("128:7,512:2,1536:1") == [(128, 0.7), (512, 0.2), (1536, 0.1)]
    for bad in ("", "0:1", "128:-1", "128:0"):
        with pytest.raises(ValueError):
            goodput.parse_mix(bad)


def test_mix_workload_has_exact_shares_and_unit_poisson_arrivals():
    reqs = goodput.mix_workload(60, goodput.parse_mix(goodput.DEFAULT_MIX), 64, _words, seed=3)
    assert Counter(r.prompt_tokens for r in reqs) == {128: 42, 512: 12, 1536: 6}
    arrivals = [r.unit_at for r in reqs]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    assert 30 < arrivals[-1] < 100  # 59 gaps of mean 1 s
    assert arrivals == goodput.unit_arrivals(60, 3)  # every rate replays the same arrivals, scaled
    assert all(r.max_tokens == 64 for r in reqs)


def test_chat_turns_resend_their_history_in_order():
    reqs = goodput.chat_workload(4, 3, 16, 8, 8, 32, _counter_maker(), seed=1)
    assert len(reqs) == 12
    by_conv: dict[int, list[goodput.Request]] = {}
    for r in reqs:
        by_conv.setdefault(r.conversation, []).append(r)
    prefixes = set()
    for turns in by_conv.values():
        assert [t.turn for t in turns] == [0, 1, 2]  # in arrival order
        for earlier, later in itertools.pairwise(turns):
            assert later.prompt.startswith(earlier.prompt)  # the history is a shared prefix
            assert later.prompt_tokens == earlier.prompt_tokens + 8 + 8  # its answer + a new message
        assert turns[0].prompt_tokens == 16 + 8
        prefixes.add(turns[0].prompt.split()[0])
    assert len(prefixes) == 4  # no prefix shared across conversations


def _result(prompt: int, ttft: float | None, tpot: float | None, error: str | None = None):
    return load_gen.Result(0, prompt, output_tokens=64, ttft_ms=ttft, tpot_ms=tpot, error=error)


def test_objective_is_the_issue_formula():
    o = goodput.Objective(1000.0, 2.0, 100.0)
    assert o.ttft_limit_ms(128) == 1000.0 and o.ttft_limit_ms(1536) == 3072.0
    assert o.met(_result(1536, 3000.0, 99.0))
    assert not o.met(_result(128, 1001.0, 50.0))
    assert not o.met(_result(128, 500.0, 100.5))
    assert not o.met(_result(128, None, None))
    assert not o.met(_result(128, 10.0, 10.0, error="HTTP 503"))


def _points(*pairs: tuple[float, float]) -> list[dict]:
    return [{"system": "pd", "rate": r, "attainment": a} for r, a in pairs]


def test_goodput_is_the_highest_rate_below_the_first_miss():
    assert goodput.goodput(_points((0.25, 0.98), (0.5, 0.91), (0.75, 0.6), (1.0, 0.95)), 0.9) == 0.5
    assert goodput.goodput(_points((0.25, 0.5)), 0.9) == 0.0
    assert goodput.next_bisection(_points((0.25, 0.98), (0.5, 0.91), (0.75, 0.6)), 0.9) == 0.625
    assert goodput.next_bisection(_points((0.25, 0.5)), 0.9) == 0.125
    assert goodput.next_bisection(_points((0.25, 0.95)), 0.9) is None


def test_point_row_table_and_plot(tmp_path):
    o = goodput.Objective()
    results = [_result(128, 300.0, 40.0), _result(1536, 4000.0, 40.0), _result(512, 900.0, 150.0),
               _result(128, None, None, error="HTTP 503")]
    row = goodput.point_row("pd", 0.5, results, 10.0, o)
    assert row["attainment"] == 0.25 and row["errors"] == 1 and row["requests"] == 4
    points = [row, {**row, "system": "vllm", "attainment": 0.95, "rate": 0.5}]
    text = goodput.table(points, 0.9)
    assert "goodput (90% within the objective) vllm: 0.5 req/s" in text
    assert "goodput pd / vllm: 0.00x" in text
    goodput.plot(points, 0.9, "t", tmp_path / "g.png")
    assert (tmp_path / "g.png").stat().st_size > 1000


def test_command_line_defaults_follow_the_issue():
    a = goodput.parse_args([])
    assert a.systems == ["pd", "vllm"] and a.rates == [0.25, 0.5, 0.75, 1.0]
    assert a.mix == goodput.DEFAULT_MIX and a.max_tokens == 64 and a.requests == 60
    assert (a.ttft_ms, a.ttft_ms_per_token, a.tpot_ms, a.attainment) == (1000.0, 2.0, 100.0, 0.9)
    s = goodput.parse_args(["--workload", "summarize"])
    assert s.mix == goodput.SUMMARIZE_MIX and s.max_tokens == 32
    with pytest.raises(SystemExit):
        goodput.parse_args(["--systems", "tgi"])


def test_each_point_salts_its_prompts_so_no_prefix_cache_carries_over():
    make = load_gen.PromptMaker(None, 0).make
    tok = load_gen._vocabulary(None)[0]
    mix = goodput.mix_workload(6, [(40, 1.0)], 8, make, seed=2)
    chat = goodput.chat_workload(2, 3, 24, 8, 8, 8, make, seed=2)
    first, second = goodput.salted(mix, 1), goodput.salted(mix, 2)
    for a, b, r in zip(first, second, mix, strict=True):
        assert len(tok.encode(a.prompt)) == len(tok.encode(b.prompt)) == r.prompt_tokens
        assert a.prompt.split()[1:] == b.prompt.split()[1:] == r.prompt.split()[1:]
        assert tok.encode(a.prompt)[0] != tok.encode(b.prompt)[0]  # not even the first block is shared
    turns = goodput.salted(chat, 1)
    for conv in (0, 1):
        mine = [r.prompt for r in turns if r.conversation == conv]
        assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(mine))
    one_word = goodput.mix_workload(2, [(1, 1.0)], 8, make, seed=2)  # nothing after its only word
    assert [len(tok.encode(r.prompt)) for r in goodput.salted(one_word, 3)] == [1, 1]


def test_rescore_scores_earlier_runs_against_another_objective(tmp_path):
    results = [_result(128, 1500.0, 40.0), _result(1536, 5000.0, 120.0), _result(512, 900.0, 90.0)]
    run = tmp_path / "run"
    run.mkdir()
    row = goodput.point_row("pd", 0.5, results, 12.0, goodput.Objective())
    assert row["attainment"] == round(1 / 3, 4)  # 1.5 s misses 1 s; 120 ms misses 100 ms
    (run / "points.jsonl").write_text(json.dumps({**row, "loadavg_1m": 0.7,
                                                  "results": [asdict(r) for r in results]}) + "\n")
    (point,) = goodput.rescore([str(run)], goodput.Objective(2000.0, 4.0, 150.0))
    assert point["attainment"] == 1.0 and point["loadavg_1m"] == 0.7 and point["wall_s"] == 12.0
    assert point["system"] == "pd"
    assert goodput.rescore([f"after={run}"], goodput.Objective())[0]["system"] == "after"
    out = tmp_path / "out"
    assert goodput.main(["--rescore", str(run), "--out", str(out), "--ttft-ms", "2000",
                         "--ttft-ms-per-token", "4", "--tpot-ms", "150"]) == 0
    report = json.loads((out / "goodput.json").read_text())
    assert report["goodput"] == {"pd": 0.5} and (out / "goodput.png").is_file()


# ----------------------------------------------------------------------------- the aiperf point


def _aiperf_line(start_ns: int, isl: int, ttft: float, itl: float, latency: float,
                 error: dict | None = None) -> str:
    """One line of aiperf 0.13's profile_export.jsonl (--export-level records), the fields read here."""
    metrics = {"input_sequence_length": {"value": isl, "unit": "tokens"},
               "output_sequence_length": {"value": 64, "unit": "tokens"},
               "time_to_first_token": {"value": ttft, "unit": "ms"},
               "inter_token_latency": {"value": itl, "unit": "ms"},
               "request_latency": {"value": latency, "unit": "ms"}}
    doc = {"metadata": {"session_num": 0, "request_start_ns": start_ns, "benchmark_phase": "profiling"},
           "metrics": {} if error else metrics}
    if error:
        doc["error"] = error
    return json.dumps(doc) + "\n"


def test_aiperf_point_is_the_mix_in_request_rate_mode_scored_from_its_records(tmp_path):
    assert goodput.seq_dist(goodput.parse_mix(goodput.DEFAULT_MIX), 64) == "128,64:70;512,64:20;1536,64:10"
    assert goodput.seq_dist(goodput.parse_mix("1:1,2:1,3:1"), 8) == "1,8:34;2,8:33;3,8:33"  # sums to 100
    run = tmp_path / "aiperf-pd" / "deep"
    run.mkdir(parents=True)
    s = 1_000_000_000
    (run / "profile_export.jsonl").write_text(
        _aiperf_line(3 * s, 1536, 2500.0, 50.0, 5650.0)      # within max(1 s, 3,072 ms)
        + _aiperf_line(1 * s, 128, 900.0, 120.0, 8460.0)     # TPOT over 100 ms
        + _aiperf_line(2 * s, 512, 1100.0, 60.0, 4880.0)     # TTFT over max(1 s, 1,024 ms)
        + _aiperf_line(4 * s, 128, 0.0, 0.0, 0.0, error={"code": 503, "message": "queue full"}))
    results, wall = goodput.aiperf_results(tmp_path / "aiperf-pd")
    assert [r.prompt_tokens for r in results] == [128, 512, 1536, 0]  # in the order sent
    assert results[-1].error == "queue full" and results[0].tpot_ms == 120.0
    assert wall == pytest.approx(1 + 8.46 - 1)  # the first start to the last end (the first 128's)
    row = goodput.point_row("pd", 0.5, results, wall, goodput.Objective())
    assert (row["attainment"], row["errors"]) == (0.25, 1)
    assert row["realized_rate"] == 1.0  # 4 arrivals 1 s apart
    a = goodput.parse_args(["--aiperf", "0.5"])
    assert a.aiperf == 0.5
    with pytest.raises(SystemExit):
        goodput.parse_args(["--workload", "chat", "--aiperf", "0.5"])
    text = goodput.table([{**row, "attainment": 0.5}], 0.9, [{**row, "client": "aiperf"}])
    assert "aiperf pd at 0.5 req/s (realized 1.0): attainment 0.25 (load_gen 0.50, realized 1.0)" in text
    goodput.plot([row], 0.9, "t", tmp_path / "g.png", [row])
    assert (tmp_path / "g.png").stat().st_size > 1000
