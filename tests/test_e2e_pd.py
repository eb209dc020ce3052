"""e2e: the whole repository (llm, pd, colocated, prefill, decode, pre/postprocess) on one tritonserver
with the shm transport: tokens, text, HTTP endpoints, KV bytes, faults, cancellation, load, metrics.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml

from rngd_pd.engine.colocated import ColocatedEngine
from rngd_pd.model.sampling import SamplingParams
from rngd_pd.testing import e2e as E
from tests.triton_harness import triton_server

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, str]]:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    shm_root = tempfile.mkdtemp(prefix="rngd-pd-e2e-shm-", dir=base)
    log = Path(tempfile.mkdtemp(prefix="rngd-pd-e2e-")) / "kv.jsonl"
    yield {"AIRM_KV_TRANSPORT": "shm", "PD_SHM_ROOT": shm_root, "RNGD_PD_KV_DEBUG_LOG": str(log)}
    shutil.rmtree(shm_root, ignore_errors=True)
    shutil.rmtree(log.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def server(env: dict[str, str]):
    with triton_server(E.REPOSITORY, "cpu", env) as s:
        yield s


LLM_OUT = ("text_output", "output_ids", "finish_reason")
PD_OUT = ("output_ids", "finish_reason")


@pytest.mark.parametrize("text", E.PROMPTS)
def test_llm_grpc_stream_matches_colocated_engine(server, text: str) -> None:
    ids, ref_text, reason = E.reference(text)
    responses = E.stream_infer(server.grpc_url, "llm", E.llm_inputs(text), LLM_OUT)
    assert E.ids_of(responses) == list(ids)
    assert len(responses) == len(ids)  # one response per token
    assert E.text_of(responses) == ref_text
    assert E.reason_of(responses) == reason


def test_llm_without_stream_is_one_response_with_the_whole_text(server) -> None:
    text = E.PROMPTS[4]
    ids, ref_text, _ = E.reference(text)
    responses = E.stream_infer(server.grpc_url, "llm", E.llm_inputs(text, stream=False), LLM_OUT)
    assert len(responses) == 1
    assert E.ids_of(responses) == list(ids) and E.text_of(responses) == ref_text


@pytest.mark.parametrize("stream", [True, False])
def test_llm_text_stops_before_the_stop_string(server, stream: bool) -> None:
    text = E.PROMPTS[1]
    ids, ref_text, _ = E.reference(text)
    stop = " reflection of"  # spans several tokens of the reference text
    assert stop in ref_text
    values = E.llm_inputs(text, stream=stream, stop=np.array([stop.encode(), b"never there"], np.object_))
    responses = E.stream_infer(server.grpc_url, "llm", values, LLM_OUT)
    assert E.text_of(responses) == ref_text[:ref_text.find(stop)]  # as vLLM/OpenAI: never the stop string
    assert E.reason_of(responses) == "stop"
    got = E.ids_of(responses)
    assert got == list(ids[:len(got)]) and stop in E.loaded_model().tokenizer.decode(got)


def test_llm_http_generate_and_generate_stream(server) -> None:
    text = E.PROMPTS[0]
    ids, ref_text, reason = E.reference(text)
    status, body = E.http_post(server.http_url, "/v2/models/llm/generate",
                               {"text_input": text, "max_tokens": E.MAX_TOKENS})
    assert status == 200, body
    one = json.loads(body)
    assert one["text_output"] == ref_text and one["output_ids"] == list(ids)
    assert one["finish_reason"] == reason
    status, body = E.http_post(server.http_url, "/v2/models/llm/generate_stream",
                               {"text_input": text, "max_tokens": E.MAX_TOKENS, "stream": True})
    assert status == 200, body
    events = E.sse_events(body)
    assert [e["output_ids"] for e in events] == list(ids)
    assert "".join(e["text_output"] for e in events) == ref_text


@pytest.mark.parametrize("model", ["pd", "colocated"])
def test_pd_and_colocated_stream_the_same_tokens(server, model: str) -> None:
    for text in E.PROMPTS[:2]:
        ids, _, reason = E.reference(text)
        responses = E.stream_infer(server.grpc_url, model, E.pd_inputs(E.prompt_ids(text)), PD_OUT)
        assert E.ids_of(responses) == list(ids) and E.reason_of(responses) == reason
        status, body = E.http_post(server.http_url, f"/v2/models/{model}/generate",
                                   {"input_ids": E.prompt_ids(text), "max_tokens": E.MAX_TOKENS})
        assert status == 200 and json.loads(body)["output_ids"] == list(ids), body


def test_ignore_eos_runs_past_eos_to_max_tokens(server) -> None:
    tokenizer = E.loaded_model().tokenizer  # the chat answer to "Hi!" is short and ends with EOS
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}]),
                           add_special_tokens=False)
    body = {"input_ids": ids, "max_tokens": 24}
    status, plain = E.http_post(server.http_url, "/v2/models/pd/generate", body)
    assert status == 200, plain
    plain = json.loads(plain)
    assert plain["finish_reason"] == "eos" and len(plain["output_ids"]) < 24, plain
    status, forced = E.http_post(server.http_url, "/v2/models/pd/generate", {**body, "ignore_eos": True})
    assert status == 200, forced
    forced = json.loads(forced)
    assert forced["finish_reason"] == "length" and len(forced["output_ids"]) == 24, forced
    assert forced["output_ids"][: len(plain["output_ids"])] == plain["output_ids"]


def test_kv_bytes_decode_received_equal_those_prefill_produced(server, env) -> None:
    E.stream_infer(server.grpc_url, "pd", E.pd_inputs(E.prompt_ids(E.PROMPTS[3])), PD_OUT)
    assert E.assert_kv_bytes_match(Path(env["RNGD_PD_KV_DEBUG_LOG"])) >= 1


def _error_of(server, model: str, values: dict) -> str:
    with pytest.raises(RuntimeError) as info:
        E.stream_infer(server.grpc_url, model, values, PD_OUT)
    return str(info.value)


def test_prompt_over_the_context_limit_is_rejected(server) -> None:
    message = _error_of(server, "pd", E.pd_inputs([42] * 2100, max_tokens=4))
    assert "ContextLengthError" in message and "2048" in message, message
    message = _error_of(server, "llm", E.llm_inputs("hello " * 1000, max_tokens=1500))
    assert "ContextLengthError" in message, message


@pytest.mark.parametrize(("extra", "what"), [
    ({"temperature": np.array([-1.0], np.float32)}, "temperature"),
    ({"top_p": np.array([2.0], np.float32)}, "top_p"),
    ({"max_tokens": np.array([0], np.int32)}, "max_tokens"),
])
def test_bad_parameter_values_are_rejected(server, extra: dict, what: str) -> None:
    message = _error_of(server, "pd", {**E.pd_inputs(E.prompt_ids("hi")), **extra})
    assert "ConfigError" in message and what in message, message


def _metric(server, name: str) -> float:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    values = [float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name)]
    return sum(values)


def test_client_cancel_frees_the_decode_slot_and_the_kv(server, env) -> None:
    ids = E.prompt_ids(E.PROMPTS[1])
    got = E.stream_infer(server.grpc_url, "pd", E.pd_inputs(ids, max_tokens=400), PD_OUT, cancel_after=3)
    assert len(got) == 3
    deadline = time.monotonic() + 10  # 400 tokens would take far longer than this
    while _metric(server, "airm_decode_requests_in_flight") > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _metric(server, "airm_decode_requests_in_flight") == 0
    from rngd_pd.kv.shm.transport import linked_bytes

    assert linked_bytes(env["PD_SHM_ROOT"]) == 0, "KV blobs left behind in shm"
    text = E.PROMPTS[0]
    responses = E.stream_infer(server.grpc_url, "pd", E.pd_inputs(E.prompt_ids(text)), PD_OUT)
    assert E.ids_of(responses) == list(E.reference(text)[0])


def _pd_stub_threads(server) -> int:
    return E.thread_count(E.stub_pid(server.proc.pid, "pd"))


def test_cancelled_requests_leave_no_thread_behind_in_pd(server) -> None:
    """Regression: decode ended a cancelled request with an error response, which Triton 2.51 never
    delivered to pd's BLS stream, so pd's thread waiting on it stayed parked: one per cancel."""
    ids = E.prompt_ids(E.PROMPTS[1])
    E.stream_infer(server.grpc_url, "pd", E.pd_inputs(ids, max_tokens=2), PD_OUT)
    before = _pd_stub_threads(server)
    for _ in range(4):
        got = E.stream_infer(server.grpc_url, "pd", E.pd_inputs(ids, max_tokens=400), PD_OUT, cancel_after=2)
        assert len(got) == 2
    deadline = time.monotonic() + 10
    while _pd_stub_threads(server) > before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _pd_stub_threads(server) <= before


def test_corrupted_blob_fails_that_request_naming_the_transport(server, env) -> None:
    import tritonclient.grpc as grpcclient

    from rngd_pd.kv import load_transport

    ids, key = E.prompt_ids(E.PROMPTS[2]), "e2e-corrupt-" + os.urandom(4).hex()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.infer("prefill", E.grpc_inputs({"request_key": np.array([key.encode()], dtype=np.object_),
                                           "input_ids": np.array(ids, np.int32)}))
    shm = load_transport("shm", root=env["PD_SHM_ROOT"])
    try:
        blob = np.zeros(1 << 20, np.uint8)
        n = shm.pull(key, 3, blob, timeout=5)
        blob[n // 2] ^= 0xFF
        shm.push(key, 3, blob[:n])  # replaces blob 3 with a flipped byte, as a bad link would
        message = _error_of(server, "decode", {"request_key": np.array([key.encode()], dtype=np.object_),
                                               "prompt_len": np.array([len(ids)], np.int32),
                                               "max_tokens": np.array([4], np.int32)})
    finally:
        shm.release(key)
        shm.close()
    assert "TransportIntegrityError" in message and "shm" in message, message
    text = E.PROMPTS[0]  # the server keeps serving
    responses = E.stream_infer(server.grpc_url, "llm", E.llm_inputs(text), LLM_OUT)
    assert E.ids_of(responses) == list(E.reference(text)[0])


def _concurrent_streams(server, n: int, timeout: float) -> tuple[list, list]:
    """`n` streams at once, half to pd (token ids), half to llm (text); (results, expected ids)."""
    texts = [E.PROMPTS[i % len(E.PROMPTS)] for i in range(n)]
    expected = [list(E.reference(t)[0]) for t in texts]
    values = [E.llm_inputs(t) if i % 2 else E.pd_inputs(E.prompt_ids(t)) for i, t in enumerate(texts)]
    results: list[list[int] | BaseException] = [[] for _ in texts]

    def one(i: int) -> None:
        try:
            model = "llm" if i % 2 else "pd"
            results[i] = E.ids_of(E.stream_infer(server.grpc_url, model, values[i], PD_OUT, timeout=timeout))
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * timeout)
    return results, expected


def test_16_concurrent_streams_all_complete_with_correct_tokens(server) -> None:
    results, expected = _concurrent_streams(server, 16, timeout=300)
    assert results == expected


def test_pd_reaches_decode_through_this_servers_own_grpc_endpoint(server) -> None:
    """decode_via=grpc, the default: the endpoint comes from tritonserver's command line (decoupled
    BLS deadlocks Triton 2.51's stub under load, rngd_pd.stubs.pd_model)."""
    log = server._log.read_text(errors="replace")
    assert f"pd reaches decode through this server's gRPC endpoint {server.grpc_url}" in log


@pytest.mark.long  # the path pd left (decode_via=bls), kept working: make test-long
def test_decode_by_bls_still_serves_correct_tokens(env: dict[str, str]) -> None:
    """decode_via=bls (forced, or where the server has no plain gRPC) is the old path, kept working."""
    with triton_server(E.REPOSITORY, "cpu", {**env, "RNGD_PD_DECODE_VIA": "bls"},
                       models=["pd", "llm"]) as bls_server:
        results, expected = _concurrent_streams(bls_server, 4, timeout=300)
        assert results == expected
        assert "pd reaches decode by BLS (decode_via=bls)" in bls_server._log.read_text(errors="replace")


def test_stub_threads_do_not_grow_with_the_requests_served(server) -> None:
    """pd and decode run requests on fixed pools and send through one thread each: after rounds of 16
    concurrent streams their stubs have as many threads as after the first round, within a bound."""
    stubs = {m: E.stub_pid(server.proc.pid, m) for m in ("pd", "decode", "prefill")}
    counts = []
    for _ in range(3):
        results, expected = _concurrent_streams(server, 16, timeout=300)
        assert results == expected
        counts.append({m: E.thread_count(pid) for m, pid in stubs.items()})
    assert counts[2] == counts[1], counts
    # pd: 32 request workers + 32 decode-stream readers + the sender + the gRPC loop (its streams to
    # decode) + gRPC's and Triton's own few (77 in all here); decode: 8 KV loaders + scheduler +
    # sender + torch/Triton's own
    assert counts[2]["pd"] <= 2 * 32 + 24 and counts[2]["decode"] <= 8 + 16, counts


def test_metrics_show_the_airm_families_after_traffic(server) -> None:
    E.stream_infer(server.grpc_url, "llm", E.llm_inputs(E.PROMPTS[0]), LLM_OUT)
    with urllib.request.urlopen(server.metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    for family in ("airm_ttft_p90_ms", "airm_tpot_p90_ms", "airm_tok_s", "airm_ttft_seconds_bucket"):
        assert f"\n{family}{{" in text, family
    assert 'airm_kv_transfer_ms{kv_transport="shm"' in text or 'kv_transport="shm"' in text
    assert _metric(server, 'airm_ttft_p90_ms{model="pd"}') > 0


def test_a_repeated_prefix_is_reused_by_prefill_with_the_same_tokens(server) -> None:
    """The second request shares the first one's prompt but its last words: prefill computes only
    those (the hit counter grows by the shared blocks) and the tokens equal the colocated engine's."""
    shared = " ".join(E.PROMPTS) + " Answer each of these in order, briefly, and number the answers:"
    before = _metric(server, 'rngd_pd_prefix_cache_hits_total{model="prefill"}')
    for tail in (" one.", " two, please."):
        ids, _, reason = E.reference(shared + tail)
        got = E.stream_infer(server.grpc_url, "pd", E.pd_inputs(E.prompt_ids(shared + tail)), PD_OUT)
        assert E.ids_of(got) == list(ids) and E.reason_of(got) == reason
    assert _metric(server, 'rngd_pd_prefix_cache_hits_total{model="prefill"}') - before >= 32
    assert 0 < _metric(server, 'rngd_pd_prefix_cache_hit_rate{model="prefill"}') <= 1


def test_a_long_prompt_goes_to_prefill_in_chunks_and_a_short_one_goes_between(server) -> None:
    """A 1,300-token prompt is prefilled as three requests (pd's prefill_chunk 512: two cache_only,
    then the hand-off) with the tokens of the in-process engine, and the prefix cache counts none of
    its own chunks as hits; short prompts sent just after a long one are prefilled between its chunks."""
    text = " ".join(f"Line {i}: the {('red', 'blue', 'green')[i % 3]} crate weighs {i * 7 % 50} kg."
                    for i in range(200))
    long_ids = E.prompt_ids(text)[:1300]
    assert len(long_ids) == 1300
    with ColocatedEngine(E.loaded_model(), num_slots=1, max_len=2048) as engine:
        want = engine.generate(long_ids, SamplingParams(max_tokens=8)).token_ids
    hits = _metric(server, 'rngd_pd_prefix_cache_hits_total{model="prefill"}')
    served = E.stream_infer(server.grpc_url, "pd", E.pd_inputs(long_ids, max_tokens=8), PD_OUT, timeout=300)
    assert E.ids_of(served) == list(want)
    assert _metric(server, 'rngd_pd_prefix_cache_hits_total{model="prefill"}') == hits
    # one token each: a request ends when its prefill does; a fresh long prompt, two short ones after it
    long_ids = long_ids[::-1]
    with ColocatedEngine(E.loaded_model(), num_slots=1, max_len=2048) as engine:
        want = engine.generate(long_ids, SamplingParams(max_tokens=1)).token_ids
    done: dict[str, float] = {}
    got: dict[str, list[int]] = {}

    def run(name: str, ids: list[int]) -> None:
        got[name] = E.ids_of(E.stream_infer(server.grpc_url, "pd", E.pd_inputs(ids, max_tokens=1), PD_OUT,
                                            timeout=300))
        done[name] = time.monotonic()

    threads = [threading.Thread(target=run, args=("long", long_ids))]
    threads[0].start()
    time.sleep(0.3)  # the long prompt's first chunk is in prefill
    short = [(f"short{i}", E.prompt_ids(E.PROMPTS[i])) for i in range(2)]
    threads += [threading.Thread(target=run, args=(name, ids)) for name, ids in short]
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(300)
    assert got["long"] == list(want)
    for i, (name, _) in enumerate(short):
        assert got[name] == list(E.reference(E.PROMPTS[i])[0][:1])
        assert done[name] < done["long"], done  # first come, first served would end the long one first


@pytest.mark.long
def test_the_server_unloads_pd_promptly_after_traffic(tmp_path: Path, env: dict[str, str]) -> None:
    """Regressions: a cancelled request kept pd busy for 30 s (its decode stream's last response never
    came back), finished BLS streams still held at pd's exit hung its unload, and an llm request that
    failed after pd had streamed a token stayed in flight; each outlived the server's exit timeout."""
    from rngd_pd.serve.server import ServerConfig, TritonServer

    log = tmp_path / "tritonserver.log"
    # 30 s: a hang outlives any exit timeout, but unloading six torch models on a loaded 2-core host
    # took 11-12 s (every model had let go; the last ones were still freeing their weights)
    sized = {**env, "RNGD_PD_PARAM_NUM_SLOTS": "0"}  # decode sizes its slots at load, as served
    cfg = ServerConfig(Path(E.REPOSITORY), "cpu", http_port=0, grpc_port=0, metrics_port=0, env=sized,
                       exit_timeout_s=30)
    with TritonServer(cfg, log=log) as s:
        s.wait_ready(600)
        for text in E.PROMPTS[:3]:
            E.stream_infer(s.grpc_url, "pd", E.pd_inputs(E.prompt_ids(text)), PD_OUT)
        with pytest.raises(RuntimeError, match="ContextLengthError"):  # it once left llm "in flight"
            E.stream_infer(s.grpc_url, "llm", E.llm_inputs("hello " * 1000, max_tokens=1500), LLM_OUT)
        ids = E.prompt_ids(E.PROMPTS[1])
        got = E.stream_infer(s.grpc_url, "pd", E.pd_inputs(ids, max_tokens=1500), PD_OUT, cancel_after=3)
        assert len(got) == 3
        time.sleep(1.0)
        t0 = time.monotonic()
        s.stop()
        took = time.monotonic() - t0
    text = log.read_text(errors="replace")
    assert "unloaded 'pd'" in text and "Exit timeout expired" not in text, text[-3000:]
    assert re.search(r"decode_0_0: \d+ slots: KV memory for \d+ \(\d+ MiB each", text), text[-3000:]
    assert took < cfg.exit_timeout_s, took


# The gauges the Helm chart's EPP config tells llm-d's endpoint picker to read (role -> metric name).
EPP_GAUGES: dict[str, str] = yaml.safe_load(
    (Path(__file__).resolve().parents[1] / "deploy" / "helm" / "rngd-pd" / "values.yaml").read_text()
)["epp"]["gauges"]


def _load_gauges(server) -> dict[str, float]:
    """The chart's EPP gauges as this server exports them (by role: queued, running, kvUsage): typed
    gauge, exactly one unlabelled series each. A name the chart gives that the server does not export
    fails here."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for role, name in EPP_GAUGES.items():
        assert f"# TYPE {name} gauge" in text, name
        series = [ln for ln in text.splitlines() if ln.split(" ", 1)[0].split("{", 1)[0] == name]
        assert len(series) == 1 and series[0].startswith(name + " "), series
        out[role] = float(series[0].split()[1])
    return out


def test_the_endpoint_pickers_gauges_move_under_load(server) -> None:
    """The gauges the chart's EPP reads, scraped from the running server while 4 more requests than
    decode has slots (sized at load: the count its log gives) share them."""
    sized = re.search(r"decode_0_0: (\d+) slots: ", server.log_tail(100_000))
    assert sized, "decode logs the slots it sized at load"
    slots = int(sized.group(1))
    assert 1 <= slots <= 16
    ids = E.prompt_ids(E.PROMPTS[1])
    deadline = time.monotonic() + 30
    while any(_load_gauges(server).values()) and time.monotonic() < deadline:
        time.sleep(0.5)  # what earlier tests left is still draining
    assert not any(_load_gauges(server).values())
    threads = [threading.Thread(target=E.stream_infer, args=(server.grpc_url, "pd",
                                E.pd_inputs(ids, max_tokens=48), PD_OUT), kwargs={"timeout": 300})
               for _ in range(slots + 4)]  # 4 wait
    for t in threads:
        t.start()
    peak = dict.fromkeys(EPP_GAUGES, 0.0)
    assert set(peak) == {"queued", "running", "kvUsage"}
    while any(t.is_alive() for t in threads):
        for name, value in _load_gauges(server).items():
            peak[name] = max(peak[name], value)
        time.sleep(0.2)
    for t in threads:
        t.join()
    assert peak["queued"] >= 1 and 1 <= peak["running"] <= slots, peak
    assert 0 < peak["kvUsage"] <= 1.0, peak
    deadline = time.monotonic() + 10
    while any(_load_gauges(server).values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _load_gauges(server) == dict.fromkeys(peak, 0.0)
