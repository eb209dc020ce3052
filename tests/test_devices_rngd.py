"""FuriosaAI RNGD: the environment check, compile_check's parsing, the runtime refusing without a
card, and (where `make rngd-env` was run) the furiosa compiler over the default graphs.

Nothing here imports furiosa: the SDK lives in .venv-rngd (torch 2.10) and is reached only through
`rngd_pd.devices.rngd.graphs` run as a subprocess there.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from rngd_pd.config.env import RNGD_PD_RNGD_VENV
from rngd_pd.devices.base import Device
from rngd_pd.devices.rngd import env as rngd_envs
from rngd_pd.devices.rngd import graphs as rngd_graphs
from rngd_pd.devices.rngd import messages
from rngd_pd.devices.rngd import runtime as rngd
from rngd_pd.devices.rngd import setup as rngd_setup
from rngd_pd.devices.runtime import GraphShapes
from rngd_pd.errors import ConfigError, DeviceUnavailableError, RngdPdError

RNGD0 = Device("rngd", 0, "rngd:0", "test")


def _fake_env(tmp_path, *, installed=True):
    venv = tmp_path / "venv-rngd"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\nexit 3\n")
    if installed:
        (venv / ".installed").touch()
    return {RNGD_PD_RNGD_VENV.name: str(venv), "RNGD_PD_DEV_ROOT": str(tmp_path / "root")}


def test_missing_environment_says_make_rngd_env(tmp_path):
    env = {RNGD_PD_RNGD_VENV.name: str(tmp_path / "absent")}
    assert rngd_envs.rngd_python(env) is None
    with pytest.raises(DeviceUnavailableError, match=r"run `make rngd-env`"):
        rngd.compile_check(GraphShapes(prefill_chunks=(128,)), env=env)


def test_environment_without_its_stamp_counts_as_missing(tmp_path):
    env = _fake_env(tmp_path, installed=False)
    assert rngd_envs.rngd_python(env) is None
    with pytest.raises(DeviceUnavailableError, match=r"incomplete; run `make rngd-env`"):
        rngd_envs.require_rngd_python(env)


def test_compile_check_passes_the_search_and_conformance_names_it(tmp_path, monkeypatch):
    """--search reaches rngd_graphs every time (the bound serving compiles with unless told
    otherwise), and the check's detail says which search made the binary."""
    env = _fake_env(tmp_path)
    python = tmp_path / "venv-rngd" / "bin" / "python"  # answers with a row of what it was asked
    python.write_text(f"#!{sys.executable}\n" + textwrap.dedent("""
        import json, sys
        a = sys.argv
        search = a[a.index("--search") + 1]
        print(json.dumps({"name": "prefill_layer_t32", "graph": "prefill", "part": "layer", "shape": "T=32",
                          "ok": True, "stage": "done", "binary_bytes": 1, "search": search, "argv": a[1:]}))
        """))
    python.chmod(0o755)
    shapes = GraphShapes(prefill_chunks=(32,))
    (row,) = rngd.compile_check(shapes, no_cache=True, env=env)
    assert row["argv"][-3:] == ["--search", "16", "--no-cache"]
    (row,) = rngd.compile_check(shapes, search=None, env=env)
    assert row["argv"][-2:] == ["--search", "full"] and "--no-cache" not in row["argv"]
    from rngd_pd.commands import device_conformance as conformance

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    (check,) = conformance.compile_only("rngd", shapes, "compile")
    (full,) = conformance.compile_only("rngd", shapes, "compile", search=None)
    assert check.ok and check.detail.endswith("binary 1 bytes, tactic search bounded to 16 shapes")
    assert full.detail.endswith("binary 1 bytes, furiosa's full tactic search")


def test_parse_rows_keeps_only_result_lines():
    row = {"name": "prefill_t128", "shape": "T=128", "ok": True, "seconds": {"compile": 1.5}}
    text = "\n".join(["INFO furiosa_torch: Total 926 supported aten ops", json.dumps(row),
                      "{not json", json.dumps({"other": 1}), ""])
    assert rngd.parse_rows(text) == [row]


def test_graph_args_and_the_cli_agree():
    shapes = GraphShapes(prefill_chunks=(128, 512), decode=((1, 512), (8, 2048)), dtype=torch.bfloat16)
    args = rngd.graph_args(shapes)
    assert args == ["--chunks", "128,512", "--past", "", "--decode", "1x512,8x2048",
                    "--dtype", "bf16", "--kv-dtype", "bf16"]
    assert rngd_graphs.parse_chunks(args[1]) == (128, 512)
    assert rngd_graphs.parse_chunks(args[3]) == ()
    assert rngd_graphs.parse_decode(args[5]) == ((1, 512), (8, 2048))
    names = [s.name for s in rngd_graphs.specs((128, 512), ((1, 512), (8, 512), (8, 2048)), (1024,))]
    assert names == ["prefill_layer_t128", "prefill_head_t128", "prefill_layer_t512", "prefill_head_t512",
                     "prefill_layer_t128_l1024", "prefill_layer_t512_l1024",
                     "decode_layer_b1_l512", "decode_layer_b8_l512", "decode_layer_b8_l2048",
                     "decode_head_b1", "decode_head_b8"]
    assert all(rngd_graphs._spec_by_name(s.name) == s
               for s in rngd_graphs.specs((128,), ((1, 512), (8, 2048)), (256,)))
    with pytest.raises(ValueError, match="BxL"):
        rngd_graphs.parse_decode("8-2048")


def test_refused_ops_are_read_from_the_compiler_error():
    text = ('marker_err: Not importable, Node { origin: Py(0x1), name: "addmm", op: CallFunction, '
            'target: TorchOp("aten::addmm", Py(0x2)), args: [] }\n'
            'Not importable, Node { origin: Py(0x3), name: "linear", op: CallFunction, '
            'target: TorchOp("aten::linear", Py(0x4)) }')
    assert rngd_graphs.refused_ops(text) == ["aten::addmm", "aten::linear"]
    text = ("Caused by:\n   0: while verifying bitwise_not\n   1: Lowering Deadline Violation: "
            "Aten(bitwise_not) is allowed up to dfg, found in primitive.")
    assert rngd_graphs.refused_ops(text) == ["aten::bitwise_not"]


def test_last_progress_names_the_compiler_stage():
    out = ('{"name":"Compiling from dfg to primitive","subtask":false,"current_stage":1,'
           '"stages":12}\n{"name":"Compiling from primitive to kernelized","subtask":false,'
           '"current_stage":2,"stages":12}\n')
    assert rngd_graphs.last_progress(out) == "Compiling from primitive to kernelized (2/12)"
    assert rngd_graphs.last_progress("nothing") == ""


def test_compile_processes_die_with_their_caller():
    """A caller killed by its own timeout must not leave an hour-long compile behind."""
    code = ("import subprocess, time\nfrom rngd_pd.host.children import killed_with_parent\n"
            "p = subprocess.Popen(['sleep', '60'], preexec_fn=killed_with_parent)\n"
            "print(p.pid, flush=True)\ntime.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] not in "ZX"
    except FileNotFoundError:
        return False


def test_worker_messages_round_trip():
    ts = [torch.randn(3, 5).to(torch.bfloat16), torch.arange(4), torch.zeros(0, dtype=torch.float32)]
    header, out = messages.read_message(io.BytesIO(messages.pack_message({"op": "decode", "cache": 7}, ts)))
    assert header == {"op": "decode", "cache": 7}
    assert [t.dtype for t in out] == [t.dtype for t in ts]
    assert all(torch.equal(a, b) for a, b in zip(out, ts, strict=True))


def test_runtime_refuses_without_the_environment(tmp_path):
    env = {RNGD_PD_RNGD_VENV.name: str(tmp_path / "absent")}
    with pytest.raises(DeviceUnavailableError, match=r"make rngd-env"):
        rngd.RngdRuntime(RNGD0, None, env=env)


def test_runtime_refuses_without_a_card(tmp_path):
    with pytest.raises(DeviceUnavailableError, match=r"no FuriosaAI RNGD card is visible.*config-name cpu"):
        rngd.RngdRuntime(RNGD0, None, env=_fake_env(tmp_path))


def test_runtime_refuses_without_the_driver(tmp_path, monkeypatch):
    env = _fake_env(tmp_path)
    (tmp_path / "root" / "dev" / "rngd").mkdir(parents=True)
    (tmp_path / "root" / "dev" / "rngd" / "npu0").touch()
    monkeypatch.setattr(rngd, "DRIVER_LIB", "renegade-absent-here")
    with pytest.raises(DeviceUnavailableError, match=r"librenegade-absent-here\.so cannot be loaded"):
        rngd.RngdRuntime(RNGD0, None, env=env)
    with pytest.raises(DeviceUnavailableError, match=r"card 1 is not among the 1 visible"):
        rngd.RngdRuntime(Device("rngd", 1, "rngd:1"), None, env=env)


def test_runtime_is_only_for_rngd(tmp_path):
    with pytest.raises(DeviceUnavailableError, match="cannot run on 'cpu'"):
        rngd.RngdRuntime(Device("cpu", 0, "cpu"), None, env=_fake_env(tmp_path))


def _graphs(m, kind, **shape):
    """The eager (layer, head) modules of one shape, as the compiler gets them."""
    return tuple(rngd_graphs.build_wrapper(m, rngd_graphs.GraphSpec(kind, part, **shape), torch.bfloat16)[0]
                 for part in rngd_graphs.PARTS)


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in bf16 ulps of b's largest magnitude: rounding-level differences of one
    computation blocked two ways."""
    ulp = 2.0 ** (torch.floor(torch.log2(b.float().abs().max())) - 7)
    return float((a.float() - b.float()).abs().max() / ulp)


@pytest.mark.slow
def test_layer_and_head_graphs_compute_what_the_model_computes(smollm_bf16, monkeypatch):
    """The graphs handed to the furiosa compiler, chained over the model's layers with each layer's
    weights, are the model's numerics: prefill bit for bit, also padded to a longer chunk. The graphs
    attend by query blocks (plain matmuls the compiler lowers); the CPU's eager prefill by SDPA, which
    rounds differently (bench/prefill_attention.py), so the reference here attends by query blocks too,
    and the SDPA prefill is checked to a few bf16 ulps of it with the same argmax."""
    from rngd_pd.model import llama as L
    from rngd_pd.model.cache import KVCache

    m, c = smollm_bf16.model, smollm_bf16.config
    sdpa_logits, sdpa_kv = m.prefill(torch.tensor([1, 22, 333, 4444, 5, 66, 7, 8] * 5))
    monkeypatch.setattr(L, "_attend_causal_sdpa", lambda q, k, v, scale: L._attend_causal(
        q, k, v, L._causal_blocks(k.shape[1] - q.shape[1], q.shape[1]), scale))
    weights, head_w = rngd_graphs.layer_weights(m), rngd_graphs.head_weights(m)
    tokens = torch.tensor([1, 22, 333, 4444, 5, 66, 7, 8] * 5)
    ref_logits, ref_kv = m.prefill(tokens)
    flat = [t for kv in ref_kv for t in kv]
    logits, kv = rngd_graphs.prefill_chain(*_graphs(m, "prefill", t=40), m.embed_tokens(tokens),
                                           torch.tensor([39]), weights, head_w)
    assert torch.equal(logits, ref_logits)
    assert all(torch.equal(a, b) for a, b in zip(kv, flat, strict=True))
    # SDPA against query blocks: rounding apart in every layer's attention, compounded over 30 layers
    # (on the AMX Xeon of 2026-12-07 a layer's K/V up to 14 ulps of its largest value); same argmax
    assert _ulps_apart(sdpa_logits, ref_logits) <= 2
    assert torch.equal(sdpa_logits.argmax(), ref_logits.argmax())
    assert max(_ulps_apart(a, b) for a, b in zip([t for kv in sdpa_kv for t in kv], flat, strict=True)) <= 32

    n = 23  # the worker's padding: zero rows after the prompt, the head reads row n - 1
    x = torch.cat([m.embed_tokens(tokens[:n]), torch.zeros(40 - n, c.hidden_size, dtype=m.dtype)])
    logits, kv = rngd_graphs.prefill_chain(*_graphs(m, "prefill", t=40), x, torch.tensor([n - 1]),
                                           weights, head_w)
    short_logits, short_kv = m.prefill(tokens[:n])
    # Padding changes the matmuls' row count, and with it the kernel's blocking: bit-identical on
    # AVX512-BF16 CPUs; where AMX-BF16 tiles the rows the logits end up to 1.5 bf16 ulps of the largest
    # logit apart after 30 layers (0.375 at |logit| <= 33.5 on a Xeon), each layer's K/V up to 5.6 ulps
    # of its largest value. Bounds: 2 and 8 such ulps (_ulps_apart).
    assert _ulps_apart(logits, short_logits) <= 2
    assert torch.equal(logits.argmax(), short_logits.argmax())
    assert max(_ulps_apart(a[:, :n], b)
               for a, b in zip(kv, [t for pair in short_kv for t in pair], strict=True)) <= 8

    p = 16  # a chunk after a past of 16 tokens, padded to a bucket of 32 (the engine's chunked path)
    past = [t[:, :p] for t in flat]
    padded = [torch.cat([t, torch.zeros(t.shape[0], 32 - p, t.shape[2], dtype=t.dtype)], 1) for t in past]
    cos, sin = m._rope(*m.rope.span(p, 40))
    x = torch.cat([m.embed_tokens(tokens[p:]), torch.zeros(p, c.hidden_size, dtype=m.dtype)])
    layer = rngd_graphs.build_wrapper(m, rngd_graphs.GraphSpec("prefill", t=40, l=32), torch.bfloat16)[0]
    past = (cos, sin, rngd_graphs.past_mask(p, 32, 40), padded)
    logits, kv = rngd_graphs.prefill_chain(layer, _graphs(m, "prefill", t=40)[1], x, torch.tensor([39 - p]),
                                           weights, head_w, past)
    assert _ulps_apart(logits, ref_logits) <= 2  # the whole prompt's last logits
    assert torch.equal(logits.argmax(), ref_logits.argmax())
    assert max(_ulps_apart(a[:, : 40 - p], b[:, p:]) for a, b in zip(kv, flat, strict=True)) <= 8

    cache = KVCache(c, 2, 64, torch.bfloat16)
    cache.load_all(0, ref_kv)
    kv = [t.clone() for pair in zip(cache.k, cache.v, strict=True) for t in pair]
    step = (torch.tensor([9, 10]), torch.tensor([40, 0]), torch.tensor([0, 1]))
    got, kv = rngd_graphs.decode_chain(*_graphs(m, "decode", b=2, l=64), m.embed_tokens(step[0]), *step[1:],
                                       kv, weights, head_w)
    ref = m.decode_step(step[0], step[1], cache, step[2])
    # decode_step runs oneDNN-packed projections on the CPU and attends by SDPA over 48 keys, the graph
    # F.linear and matmuls over its whole bucket: the same model, not the same bits (measured 1 ulp of the
    # largest logit, 4.5 of the K/V's largest value)
    assert _ulps_apart(got, ref) <= 2
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    written = [t for pair in zip(cache.k, cache.v, strict=True) for t in pair]
    assert max(_ulps_apart(a, b) for a, b in zip(kv, written, strict=True)) <= 8


def test_graphs_hold_no_weights_and_take_embedding_rows_from_the_host(smollm_bf16):
    """Every weight is a graph input (so one compiled layer graph serves all 30 layers, and the
    compiler never holds the model), and no graph looks up the embedding table: furiosa leaves a
    gather of 64+ rows (or 16 of 32 rows) un-lowered; the host does it (Llama.embed_tokens)."""
    m = smollm_bf16.model
    for spec in rngd_graphs.specs((64,), ((2, 32),), (48,)):
        ep = rngd_graphs.export(m, spec, torch.bfloat16)
        kinds = {s.kind.name for s in ep.graph_signature.input_specs}
        assert kinds <= {"USER_INPUT", "BUFFER"}, (spec, kinds)  # the buffers: RoPE rows, index ranges
        big = [s.target for s in ep.graph_signature.input_specs if s.kind.name == "BUFFER"
               and ep.state_dict.get(s.target, ep.constants.get(s.target)) is not None
               and (ep.state_dict.get(s.target, ep.constants.get(s.target))).numel() > 64 * 1024]
        assert not big, (spec, big)
        targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
        assert not {t for t in targets if "embedding" in t or "index_select" in t}, (spec, targets)
        x = next(n for n in ep.graph.nodes if n.op == "placeholder" and n.name == "x")
        assert tuple(x.meta["val"].shape) == ((spec.t, m.config.hidden_size) if spec.kind == "prefill"
                                              else (spec.b, m.config.hidden_size))


@pytest.fixture(scope="module")
def smollm_bf16():
    from rngd_pd.model import load_model

    return load_model(None, dtype=torch.bfloat16, progress=False)


# ---------------------------------------------------------------- make test-rngd's setup and compile check


def _fake_bin(tmp_path, name, script):
    path = tmp_path / "bin" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)
    return path


def test_missing_cross_compiler_not_root_says_what_to_run(tmp_path, monkeypatch, capsys):
    """No aarch64-linux-gnu-gcc on PATH and not root: exit 1 with the exact apt-get command."""
    (tmp_path / "bin").mkdir()
    monkeypatch.setattr(rngd_graphs.os, "geteuid", lambda: 1000)
    assert rngd_graphs.ensure_toolchain(env={"PATH": str(tmp_path / "bin")}) == 1
    out = capsys.readouterr().out
    assert "FAILED (not root)" in out and "aarch64-linux-gnu-gcc is not on PATH" in out
    assert "apt-get update && apt-get install -y gcc-aarch64-linux-gnu libc6-dev-arm64-cross" in out


def test_missing_cross_compiler_as_root_installs_it(tmp_path, monkeypatch, capsys):
    """Root with apt-get: apt-get update, then install -y of both packages, then the check again."""
    log = tmp_path / "apt.log"
    ready = tmp_path / "gcc-after-install"
    ready.write_text("#!/bin/sh\ncat >/dev/null\nexit 0\n")
    ready.chmod(0o755)
    _fake_bin(tmp_path, "apt-get", f'echo "$@" >> {log}\n'
              f'[ "$1" = install ] && /bin/cp {ready} {tmp_path}/bin/aarch64-linux-gnu-gcc\nexit 0\n')
    monkeypatch.setattr(rngd_graphs.os, "geteuid", lambda: 0)
    assert rngd_graphs.ensure_toolchain(env={"PATH": str(tmp_path / "bin")}) == 0
    assert log.read_text().splitlines() == [
        "update", "install -y --no-install-recommends gcc-aarch64-linux-gnu libc6-dev-arm64-cross"]
    assert "installed" in capsys.readouterr().out


def test_cross_compiler_without_headers_is_missing(tmp_path, monkeypatch, capsys):
    _fake_bin(tmp_path, "aarch64-linux-gnu-gcc",
              "echo 'fatal error: bits/wordsize.h: No such file' >&2\nexit 1\n")
    monkeypatch.setattr(rngd_graphs.os, "geteuid", lambda: 1000)
    assert rngd_graphs.ensure_toolchain(env={"PATH": str(tmp_path / "bin")}) == 1
    assert "cannot find the aarch64 libc headers (fatal error: bits/wordsize.h" in capsys.readouterr().out


def test_configured_shapes_follow_the_model_repository():
    shapes = rngd.configured_shapes()
    assert shapes.prefill_chunks == (512,)  # prefill/config.pbtxt chunk_size, device rngd
    assert shapes.prefill_past == (512, 1024, 2048, 4096)  # ... and its max_len
    assert shapes.decode == ((8, 512), (8, 2048), (8, 4096))  # decode/configs/rngd.pbtxt
    assert (shapes.dtype, shapes.kv_dtype) == ("bf16", "bf16")  # the card's dtype, whatever the host
    files = rngd.model_configs("rngd")
    assert files["decode"].name == "rngd.pbtxt" and files["prefill"].name == "config.pbtxt"
    # config.pbtxt everywhere: decode is on atom there, colocated (device rngd) needs the same graphs
    assert rngd.model_configs("default")["decode"].name == "config.pbtxt"
    assert rngd.configured_shapes("default") == shapes
    with pytest.raises(ConfigError, match="one of rngd, default"):
        rngd.model_configs("cuda")


def rngd_missing() -> str | None:
    """What the real compiler needs and this machine lacks (.venv-rngd, the cross compiler), naming
    the make target that brings it; None when both are there."""
    if rngd_envs.rngd_python() is None:
        return f"{rngd_envs.rngd_env()} is missing: run `make rngd-env`"
    if rngd_graphs.toolchain_missing():
        return f"{rngd_graphs.toolchain_missing()} (`make rngd-toolchain`)"
    return None


def _rngd_ready_or_skip():
    """In CI (CI=true) a missing environment or cross compiler fails the test; elsewhere it skips,
    saying why. The one skip in CI: `make rngd-env` found no room on the disk for the environment
    (rngd_setup's marker says how much it needed and had)."""
    no_room = rngd_setup.no_room_marker(rngd_envs.rngd_env())
    if rngd_envs.rngd_python() is None and no_room.exists():
        pytest.skip(no_room.read_text().strip())
    why = rngd_missing()
    if why and os.environ.get("CI") == "true":
        pytest.fail(f"CI must check the RNGD compiler: {why}")
    if why:
        pytest.skip(why)


def _conformance(*args, timeout=3000):
    cmd = [sys.executable, "-m", "rngd_pd.commands.device_conformance", "rngd", "--compile-only", *args]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=rngd_envs.repo_root(), timeout=timeout)
    print(" ".join(cmd[1:]), proc.stdout, proc.stderr[-3000:], f"{time.monotonic() - t0:.0f} s", sep="\n")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "furiosa-torch 2026.4.0" in proc.stdout and "compiler fc43f6a779" in proc.stdout
    return [line.split() for line in proc.stdout.splitlines() if line.startswith(("  prefill_", "  decode_"))]


@pytest.mark.rngd
@pytest.mark.slow
@pytest.mark.timeout(6000)
def test_rngd_compile_only_conformance():
    """What `make test-rngd` checks of the RNGD compiler (docs/devices-rngd.md, "In CI"): every graph the
    model repository's RNGD configs need (prefill/config.pbtxt, decode/configs/rngd.pbtxt: per shape
    a layer graph and a head graph, and prefill's layer after each past bucket) through furiosa's
    decompositions and DFG import; and the configured graphs through all 12 compiler stages to the
    binary (no cache: a real compile), with the tactic search bounded to 16 shapes (the full search
    of the prefill layer takes more than an hour on 2 cores): the prefill chunk (layer, head, the
    layer after the first past bucket) and every decode bucket (layers, head). The layers after the
    longer pasts (1024-4096: the same ops over a longer past, ~7 min each here) are in
    docs/devices-rngd.md, compiled by the same command."""
    _rngd_ready_or_skip()
    from rngd_pd.commands import device_conformance as conformance

    shapes = rngd.configured_shapes()
    graphs = rngd_graphs.specs(shapes.prefill_chunks, shapes.decode, shapes.prefill_past)
    want = [(f"{s.kind}_{s.part}", s.shape) for s in graphs]
    rows = _conformance("--stage", "import", "--config-shapes")
    assert [(r[0], r[1], r[2]) for r in rows] == [(f"{g}@import", w, "ok") for g, w in want]
    first_past = dataclasses.replace(shapes, prefill_past=shapes.prefill_past[:1])
    rows = _conformance("--stage", "compile", *rngd.graph_args(first_past), "--no-cache",
                        "--timeout", "2400", timeout=4800)  # the search serving uses: bounded to 16 shapes
    built = rngd_graphs.specs(first_past.prefill_chunks, first_past.decode, first_past.prefill_past)
    assert [(r[0], r[1], r[2]) for r in rows] == [(f"{g.kind}_{g.part}@compile", g.shape, "ok")
                                                  for g in built]
    assert len(built) == len(graphs) - (len(shapes.prefill_past) - 1)
    assert all("binary" in " ".join(r) and "bounded to 16 shapes" in " ".join(r) for r in rows)
    assert conformance.compile_scope("compile").startswith("the whole compiler")


def test_rngd_env_without_room_says_so_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(rngd_setup, "NEED_FRESH", 1 << 60)
    venv = tmp_path / "venvs" / "venv-rngd"
    assert rngd_setup.build(venv, rngd_envs.repo_root()) == rngd_setup.NO_ROOM_EXIT
    why = rngd_setup.no_room_marker(venv).read_text()
    assert "rngd-env needs about" in why and "GB free" in why and "RNGD_PD_RNGD_VENV=" in why
    assert why.strip() in capsys.readouterr().err
    assert not venv.exists()


def test_a_disk_filling_during_pip_is_told_from_other_failures():
    full = subprocess.CompletedProcess([], 1, stderr="ERROR: Could not install packages due to an "
                                       "OSError: [Errno 28] No space left on device\n")
    with pytest.raises(rngd_setup.NoRoom, match="the disk filled while installing torch"):
        rngd_setup._check(full, "installing torch==2.10.0")
    other = subprocess.CompletedProcess([], 1, stderr="ERROR: No matching distribution found\n")
    with pytest.raises(RuntimeError, match="installing x failed \\(pip exit 1\\)"):
        rngd_setup._check(other, "installing x")


# ---------------------------------------------------------------- furiosa-smi: discovery, power, memory


class _Card:
    """A card as furiosa-smi 2026.4 hands it out (every getter a method); power and serial fail."""

    def dev_node_index(self):
        return 3

    def device_name(self):
        return "npu3"

    def power_consumption(self):
        raise RuntimeError("power sensor not ready")

    def serial(self):
        raise RuntimeError("no serial")

    def memory_usage(self):
        return type("M", (), {"total_bytes": lambda _: 48 * 10**9, "in_use_bytes": lambda _: 6 * 10**9})()

    def device_temperature(self):
        return type("T", (), {"soc_peak": lambda _: 51.5, "ambient": lambda _: 30.0})()

    def __getattr__(self, name):
        return lambda: {"uuid": "u-1", "arch": "Rngd", "firmware_version": "1.2.3", "power_limit": 180.0,
                        "liveness": True, "core_num": 8}[name]


def test_smi_reads_each_field_on_its_own_and_names_what_failed():
    from rngd_pd.commands.devices import smi_lines
    from rngd_pd.devices.rngd import smi as rngd_smi

    card = rngd_smi.describe(_Card())
    assert card["index"] == 3 and card["name"] == "npu3" and card["firmware"] == "1.2.3"
    assert card["memory"] == {"total_bytes": 48 * 10**9, "in_use_bytes": 6 * 10**9}
    assert card["temperature_c"] == {"soc_peak": 51.5, "ambient": 30.0}
    assert card["power_w"] is None and "power sensor not ready" in card["errors"]["power_w"]
    assert set(card["errors"]) == {"power_w", "serial"}
    lines = smi_lines({"sdk": {"furiosa-smi": "2026.4.0"}, "driver": "2026.4.1", "devices": [card]})
    assert lines[0] == "rngd cards (furiosa-smi 2026.4.0): driver 2026.4.1"
    assert lines[1].startswith("  npu3, npu3, fw 1.2.3, power ?, 52 C, memory 6.0 / 48.0 GB in use")
    assert lines[1].endswith("(unreadable: serial, power_w)")
    assert smi_lines({"error": "not usable"}) == ["rngd cards (furiosa-smi): not usable"]


def test_smi_snapshot_without_the_environment_names_the_fix(tmp_path):
    missing = rngd.smi_snapshot({RNGD_PD_RNGD_VENV.name: str(tmp_path / "absent")})
    assert missing["devices"] == [] and "make rngd-env" in missing["error"]


@pytest.mark.rngd
def test_smi_snapshot_runs_the_real_furiosa_smi():
    """furiosa-smi 2026.4.0 in .venv-rngd, here without a card or driver: no device, the driver's
    absence said."""
    assert rngd_envs.rngd_python() is not None, "needs .venv-rngd: run `make rngd-env`"
    smi = rngd.smi_snapshot()
    assert smi["sdk"] == {"furiosa-smi": "2026.4.0"} and not smi["error"], smi
    if not rngd.cards(rngd.RNGD):
        assert smi["devices"] == [] and smi["driver"] is None and "device not found" in smi["driver_error"]
    for card in smi["devices"]:
        assert isinstance(card["index"], int) and card["memory"]["total_bytes"] > 0, card


# ---------------------------------------------------------------- the card worker's logic, on CPU graphs


class _InProcess:
    """`_Worker.call` over an in-process CardWorker: every message and reply through the wire
    format (pack_message / read_message), a failure raised as the runtime raises it."""

    def __init__(self, worker):
        self.worker = worker
        self.decode_rows: list[int] = []  # rows of each decode step asked of the worker

    def call(self, op, tensors=(), **args):
        if op == "decode":
            self.decode_rows.append(int(tensors[0].shape[0]))
        msg, ts = messages.read_message(io.BytesIO(messages.pack_message({"op": op, **args}, list(tensors))))
        header, out = self.worker.answer(msg, ts)
        header, out = messages.read_message(io.BytesIO(messages.pack_message(header, out)))
        if header.get("error"):
            raise RngdPdError(f"RNGD worker, {op}: {header['error']}")
        return header, out


def _card_on_cpu_graphs(smollm, dtype):
    """(RngdRuntime over an in-process CardWorker whose graphs torch.export built and the CPU runs,
    its message channel) on a copy of the embedded model in `dtype`."""
    from rngd_pd.model.llama import Llama

    model = Llama(smollm.config, dtype)
    model.load_state_dict(smollm.model.state_dict())
    loaded = dataclasses.replace(smollm, model=model.eval())
    worker = rngd_graphs.CardWorker(loaded.model, torch.device("cpu"),
                                    lambda spec, kv: rngd_graphs.export(loaded.model, spec, kv).module())
    channel = _InProcess(worker)
    return rngd.RngdRuntime.over(channel, RNGD0, loaded), channel


@pytest.mark.slow
def test_rngd_runtime_and_card_worker_conform_on_cpu_graphs(smollm, hf_smollm):
    """Everything RngdRuntime and its worker do besides furiosa's compile and device (the graphs,
    per layer and head, compiled here by torch.export and run on the CPU): device conformance
    against transformers, fp32 compute and KV (logits within 1e-3). Prefill of a full chunk and of
    1.5 chunks (the second after a past padded to its bucket), decode of 2 rows at their own lengths
    and of 1 row in slot 1 of the 2 (the worker pads the width), KV through a card-resident cache."""
    from rngd_pd.devices import conformance
    from rngd_pd.model.reference import Reference

    dev, channel = _card_on_cpu_graphs(smollm, torch.float32)
    shapes = GraphShapes(prefill_chunks=(16,), decode=((2, 64),), dtype="fp32", kv_dtype="fp32")
    tol = conformance.tolerance("fp32", "fp32")
    checks = conformance.run_checks(dev, Reference.load(None, "fp32"), shapes, 4, tol)
    table = conformance.format_table("rngd (CPU graphs)", checks)
    print(table)
    assert [c.name for c in checks] == ["prepare", "prefill", "prefill", "decode", "decode", "kv"], table
    assert all(c.ok for c in checks), table
    assert "rows 1 of 2 in slots [1]" in checks[4].detail
    assert set(channel.decode_rows) == {2, 1}  # the full width ran, and the padded one
    assert {"prefill_layer_t16", "prefill_head_t16", "prefill_layer_t16_l16", "decode_layer_b2_l64",
            "decode_head_b2"} <= set(channel.worker.graphs)
    with pytest.raises(ConfigError, match="longer than the longest RNGD prefill graph"):
        dev.prefill(dev.tokens(list(range(1, 40))))
    with pytest.raises(RngdPdError, match="no memory query"):
        dev.memory()


@pytest.mark.long  # bf16 on the CPU: 5.4 min on an AVX2 host (emulated bf16); make test-long
def test_card_worker_conforms_in_bf16_at_the_configured_shapes_with_padded_rows(smollm, hf_smollm):
    """The card path in what it serves (bf16 compute and KV: the RNGD graphs' dtype) at the shapes
    the rngd configs ask for where they fit a test (rngd.configured_shapes: prefill chunk 512 and
    its first past bucket, 512; decode width 8 (num_slots) at the 512 bucket), against transformers
    in bf16: decode full and with 3 rows in slots [7, 5, 2], which the worker pads to 8."""
    from rngd_pd.devices import conformance
    from rngd_pd.model.reference import Reference

    configured = rngd.configured_shapes()
    assert (configured.dtype, configured.kv_dtype) == ("bf16", "bf16")
    shapes = dataclasses.replace(configured, prefill_past=configured.prefill_past[:1],
                                 decode=configured.decode[:1])
    assert shapes.prefill_chunks == (512,) and shapes.prefill_past == (512,) and shapes.decode == ((8, 512),)
    dev, channel = _card_on_cpu_graphs(smollm, torch.bfloat16)
    tol = conformance.tolerance("bf16", "bf16")
    checks = conformance.run_checks(dev, Reference.load(None, "bf16"), shapes, 4, tol)
    table = conformance.format_table("rngd (CPU graphs, bf16)", checks)
    print(table)
    assert [c.name for c in checks] == ["prepare", "prefill", "prefill", "decode", "decode", "kv"], table
    assert all(c.ok for c in checks), table
    assert "rows 3 of 8 in slots [7, 5, 2]" in checks[4].detail
    assert set(channel.decode_rows) == {8, 3}
    graphs = set(channel.worker.graphs)
    assert {"prefill_layer_t512", "prefill_layer_t512_l512", "decode_layer_b8_l512"} <= graphs
