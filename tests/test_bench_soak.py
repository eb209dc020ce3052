"""bench/soak.py: arguments, prompts, the process sampler (on this process and a child tree), the
disconnecting stream reader, the growth check and the summary (no tritonserver here)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import soak as K


def test_defaults() -> None:
    a = K.parse_args([])
    assert (a.clients, a.minutes, a.dtype, a.transport, a.disconnect_share) == (32, 10.0, "fp32", "shm", 0.1)
    assert a.url is None and a.json is None


@pytest.mark.parametrize("argv", [["--clients", "0"], ["--minutes", "0"], ["--disconnect-share", "1.5"],
                                  ["--transport", "nixl"], ["--server-pid", "1"], ["--prompts", "0"]])
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        K.parse_args(argv)


def test_url_mode_takes_the_sampling_hints() -> None:
    a = K.parse_args(["--url", "http://127.0.0.1:9000", "--server-pid", "42", "--shm-root", "/dev/shm/x"])
    assert (a.server_pid, a.shm_root) == (42, "/dev/shm/x")


def test_serve_command_binds_loopback_free_ports_and_the_dtype() -> None:
    cmd = K.serve_command(K.parse_args(["--transport", "tcp", "--serve-arg=--log-verbose=1"]), 9123)
    assert cmd[1:4] == ["-m", "rngd_pd.cli", "serve"]
    joined = " ".join(cmd)
    assert "--host 127.0.0.1" in joined and "--openai-port 9123" in joined and "--http-port 0" in joined
    assert "--kv-transport tcp" in joined and "--dtype fp32" in joined and cmd[-1] == "--log-verbose=1"
    assert "--dtype" not in K.serve_command(K.parse_args(["--dtype", ""]), 1)


def test_prompts_are_deterministic_distinct_varied_and_of_both_kinds() -> None:
    p = K.make_prompts(32)
    assert p == K.make_prompts(32) and len({x.text for x in p}) == 32
    assert {x.kind for x in p} == {"completion", "chat"}
    lengths = sorted(len(x.text) for x in p)
    assert lengths[-1] > 10 * lengths[0]


def test_disconnecting_clients() -> None:
    assert K.disconnecting_clients(32, 0.1) == 3
    assert K.disconnecting_clients(8, 0.1) == 1  # a share > 0 always disconnects someone
    assert K.disconnecting_clients(8, 0.0) == 0 and K.disconnecting_clients(4, 1.0) == 4


def test_proc_stats_of_this_process() -> None:
    s = K.proc_stats(os.getpid())
    assert s["pid"] == os.getpid() and s["rss_mb"] > 1 and s["threads"] >= 1 and s["fds"] >= 3
    assert K.proc_stats(2**22 + 12345) is None  # no such process


def test_proc_stats_splits_heap_from_mapped_shared_memory() -> None:
    import mmap

    before = K.proc_stats(os.getpid())
    with open("/dev/shm/rngd-pd-test-soak-" + str(os.getpid()), "w+b") as f:
        try:
            f.truncate(32 << 20)
            with mmap.mmap(f.fileno(), 32 << 20) as m:
                m[:] = b"x" * (32 << 20)  # touch every page: 32 MB of shared memory resident
                after = K.proc_stats(os.getpid())
        finally:
            os.unlink(f.name)
    assert after["shm_mb"] - before["shm_mb"] >= 30
    assert 0 < after["anon_mb"] <= after["rss_mb"]


def test_sampler_finds_named_processes_below_a_root_children_and_grandchildren() -> None:
    proc = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"], start_new_session=True)
    try:
        deadline = time.monotonic() + 5
        while len(K.find_named(os.getpid(), "sleep")) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        found = K.sample_stubs(os.getpid(), name="sleep")
        assert len(found) == 2 and set(found) == {"sleep"} | {k for k in found if k.startswith("sleep#")}
        assert all(s["threads"] == 1 and s["rss_mb"] > 0 for s in found.values())
        assert proc.pid in K.descendants(os.getpid()) and not K.sample_stubs(proc.pid, name="nothing")
        assert K.sample_stubs(None) == {}
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_stub_label_names_the_model_instance() -> None:
    args = ["/x/triton_python_backend_stub", "/repo/decode/1/model.py", "triton_python_backend_shm_region_1",
            "1048576", "1048576", "77", "/x/backends/python", "336", "decode_0_0", "DEFAULT"]
    assert K.stub_label(args) == "decode_0_0"
    assert K.stub_label(args[:3]) == "decode"
    assert K.stub_label([]) == "?"


def test_shm_blobs_are_files_under_keys(tmp_path: Path) -> None:
    assert K.count_shm_blobs(str(tmp_path)) == 0
    for key, n in (("a", 3), ("b", 2)):
        (tmp_path / "keys" / key).mkdir(parents=True)
        for i in range(n):
            (tmp_path / "keys" / key / str(i)).write_bytes(b"x")
    (tmp_path / "pool" / "w").mkdir(parents=True)
    (tmp_path / "pool" / "w" / "0-4096").write_bytes(b"x")  # idle slots are not live blobs
    assert K.count_shm_blobs(str(tmp_path)) == 5
    assert K.blob_counter("shm", str(tmp_path), None)() == 5
    assert K.blob_counter("tcp", None, None)() is None


def _sample(rss: float = 300.0, threads: int = 20, fds: int = 30, blobs: int | None = 0,
            pid: int = 7) -> dict:
    return {"t_s": 0.0, "phase": "idle", "done": 0, "errors": 0, "mismatches": 0, "disconnects": 0,
            "stubs": {"pd_0_0": {"pid": pid, "rss_mb": rss, "threads": threads, "fds": fds}}, "blobs": blobs}


def test_growth_check_tolerates_rss_within_the_bound_and_nothing_else() -> None:
    base = _sample()
    assert K.check_growth(base, _sample()) == []
    assert K.check_growth(base, _sample(rss=300 * 1.1 + 63)) == []  # +10 % + 64 MB
    assert "RSS" in K.check_growth(base, _sample(rss=300 * 1.1 + 65))[0]
    assert "threads 20 -> 21" in K.check_growth(base, _sample(threads=21))[0]
    assert K.check_growth(base, _sample(threads=21), thread_slack=1) == []
    assert "open files 30 -> 31" in K.check_growth(base, _sample(fds=31))[0]
    assert "live blobs 0 -> 4" in K.check_growth(base, _sample(blobs=4))[0]
    assert K.check_growth(base, _sample(blobs=None)) == []  # unknown is not growth
    assert K.check_growth(_sample(threads=22), _sample(threads=20)) == []  # shrinking is fine


def test_growth_check_notices_a_dead_or_restarted_stub() -> None:
    base = _sample()
    gone = dict(_sample(), stubs={})
    assert "gone" in K.check_growth(base, gone)[0]
    assert "restarted" in K.check_growth(base, _sample(pid=8))[0]
    extra = _sample()
    extra["stubs"]["decode_0_0"] = {"pid": 9, "rss_mb": 1.0, "threads": 1, "fds": 1}
    assert "appeared" in K.check_growth(base, extra)[0]


def test_stats_count_disconnects_as_expected_and_check_their_prefix() -> None:
    st = K.Stats()
    st.result(index=0, text="hello world", ref="hello world", complete=True, tokens=2, streamed=False)
    st.result(index=0, text="hello", ref="hello world", complete=False, ttft=0.1, streamed=True)
    assert st.counts() == {"done": 2, "errors": 0, "mismatches": 0, "disconnects": 1}
    st.result(index=1, text="hello", ref="hello world", complete=True)  # a complete text must be whole
    st.result(index=1, text="help", ref="hello world", complete=False)  # a cut text must be a prefix
    st.error("boom")
    assert st.counts() == {"done": 5, "errors": 1, "mismatches": 2, "disconnects": 2}
    assert st.mismatch_examples[0]["prompt"] == 1 and st.error_examples == ["boom"]
    st.result(index=1, text="help", ref="hello world", complete=False)  # the same wrong text again
    assert len(st.mismatch_examples) == 2 and st.mismatched_prompts == {1}


def test_summary_passes_a_clean_run_and_fails_on_errors_mismatches_growth_or_crash_signs() -> None:
    st = K.Stats()
    for i in range(10):
        st.result(index=0, text="a", ref="a", complete=True, tokens=16, ttft=0.1 * (i + 1), streamed=True)
    s = K.summarize(st, 20.0, _sample(), _sample(), [], [], expect_stubs=True)
    assert s["ok"] and s["requests"] == 10 and s["output_tok_s"] == 8.0
    assert (s["ttft_p50_ms"], s["ttft_p99_ms"]) == (500.0, 1000.0)
    assert s["growth"]["pd_0_0"]["threads"] == [20, 20, 0]
    assert not K.summarize(st, 20.0, _sample(), _sample(), ["stub pd_0_0 threads 20 -> 40"], [], True)["ok"]
    assert not K.summarize(st, 20.0, _sample(), _sample(), [], ["double free"], True)["ok"]
    no_stubs = dict(_sample(), stubs={})
    assert not K.summarize(st, 20.0, no_stubs, no_stubs, [], [], expect_stubs=True)["ok"]
    assert K.summarize(st, 20.0, no_stubs, no_stubs, [], [], expect_stubs=False)["ok"]
    st.error("x")
    assert "1 errors" in K.summarize(st, 20.0, _sample(), _sample(), [], [], True)["problems"]
    text = K.format_summary(s, K.parse_args([]))
    assert "OK" in text and "TTFT p50 500 ms" in text and "+10 % + 64 MB" in text


def test_percentile() -> None:
    assert K.percentile([], 0.5) is None
    assert K.percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and K.percentile([1.0, 2.0], 0.99) == 2.0


def test_table_rows_show_every_stub_and_new_ones() -> None:
    row = _sample()
    row["stubs"]["x_0_0"] = {"pid": 1, "rss_mb": 5.0, "threads": 2, "fds": 3}
    header = K.format_header(["pd_0_0"])
    line = K.format_row(row, ["pd_0_0", "gone_0_0"])
    assert "pd_0_0" in header and "300/20/30" in line and "gone" in line and "+x_0_0:5/2/3" in line


class _FakeStream:
    def __init__(self, pieces: list[str]) -> None:
        self.pieces, self.closed, self.read = pieces, False, 0

    def __iter__(self):
        for p in self.pieces:
            self.read += 1
            yield SimpleNamespace(usage=None, choices=[SimpleNamespace(text=p)])
        yield SimpleNamespace(usage=SimpleNamespace(completion_tokens=len(self.pieces)), choices=[])

    def close(self) -> None:
        self.closed = True


def _client(stream: _FakeStream):
    return SimpleNamespace(completions=SimpleNamespace(create=lambda **kw: stream))


def test_a_disconnecting_stream_is_closed_after_k_chunks() -> None:
    s = _FakeStream(["a", "b", "c", "d"])
    text, complete, tokens, ttft = K.ask(_client(s), "m", K.Prompt("completion", "p"), 4, True, 2)
    assert (text, complete, tokens) == ("ab", False, 0) and s.closed and s.read == 2 and ttft is not None
    s = _FakeStream(["a", "b"])
    assert K.ask(_client(s), "m", K.Prompt("completion", "p"), 4, True)[:3] == ("ab", True, 2) and s.closed
