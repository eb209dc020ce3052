"""The device interface: engines through it only, torch cpu/cuda, the static decode graph, the ATOM
adapter's parts that run without its SDK, conformance, and loads that refuse a missing device."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from rngd_pd.config.env import RNGD_PD_ATOM_CACHE
from rngd_pd.devices import atom
from rngd_pd.devices.base import Device
from rngd_pd.devices.binding import runtime_for
from rngd_pd.devices.runtime import DeviceRuntime, GraphShapes
from rngd_pd.devices.torch_runtime import as_runtime
from rngd_pd.errors import DeviceUnavailableError
from tests import skips

ROOT = Path(__file__).resolve().parents[1]


def test_the_engines_reach_torch_only_through_the_device_interface() -> None:
    for path in sorted((ROOT / "rngd_pd" / "engine").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            bad = [n for n in names if n == "torch" or n.startswith("torch.")]
            assert not bad, f"{path.name} imports {bad}"


def test_a_loaded_model_runs_on_the_cpu_runtime(engine_model) -> None:
    rt = as_runtime(engine_model)
    assert isinstance(rt, DeviceRuntime) and rt.device.kind == "cpu" and as_runtime(rt) is rt
    mem = rt.memory()
    assert 0 < mem.free <= mem.total


@pytest.mark.parametrize("kind", ["cuda", "rngd", "atom"])
def test_a_model_configured_for_a_missing_device_fails_to_load_naming_it(kind, monkeypatch) -> None:
    """The Triton models' load path: it must stop before any weights are loaded (never the CPU)."""
    import torch

    import rngd_pd.model
    from rngd_pd.stubs.loading import load_for
    from rngd_pd.stubs.serving import PrefillParams

    if kind == "cuda" and torch.cuda.is_available():
        pytest.skip(skips.GPU_PRESENT)

    def no_load(*a, **k):
        raise AssertionError("the model was loaded although its device is missing")

    monkeypatch.setattr(rngd_pd.model, "load_model", no_load)
    missing = {"cuda": "no CUDA device", "rngd": "FuriosaAI", "atom": "Rebellions SDK"}[kind]
    with pytest.raises(DeviceUnavailableError, match=missing) as info:
        load_for(PrefillParams(device=kind), {"model_instance_name": "prefill_0_0"})
    assert "--model-config-name cpu" in str(info.value)


def test_static_decode_graph_equals_the_eager_step(engine_model) -> None:
    """Ragged rows over whole caches: logits within fp32 tolerance, greedy tokens equal."""
    import torch

    from rngd_pd.model.cache import KVCache
    from rngd_pd.model.static import StaticDecode

    model, cfg = engine_model.model, engine_model.config
    width, bucket, steps = 3, 64, 4
    prompts = [engine_model.tokenizer.encode(t) for t in ("The capital of France is",
               "Once upon a time, in a land far away, there lived", "1, 2, 3,")]
    eager, static = KVCache(cfg, width, bucket, torch.float32), KVCache(cfg, width, bucket, torch.float32)
    graph = StaticDecode(model, max_len=bucket)
    with torch.inference_mode():
        firsts = []
        for slot, ids in enumerate(prompts):
            logits, kv = model.prefill(torch.tensor(ids), kv_dtype=torch.float32)
            eager.load_all(slot, kv)
            static.load_all(slot, kv)
            firsts.append(int(logits.argmax()))
        a_tok = b_tok = torch.tensor(firsts)
        pos = torch.tensor([len(p) for p in prompts])
        slots = torch.arange(width)
        for _ in range(steps):
            a = model.decode_step(a_tok, pos, eager, slots)
            outs = graph(b_tok, pos, *[t for kv in zip(static.k, static.v, strict=True) for t in kv])
            b = StaticDecode.write_back(static, outs, slots, pos)
            assert torch.allclose(a, b, atol=2e-3, rtol=1e-4), float((a - b).abs().max())
            a_tok, b_tok = a.argmax(-1), b.argmax(-1)
            assert torch.equal(a_tok, b_tok)
            pos = pos + 1


def test_atom_input_info_one_list_per_bucket(engine_model) -> None:
    cfg = engine_model.config
    shapes = GraphShapes(decode=((1, 512), (8, 2048)), kv_dtype="bf16")
    infos = atom.bucket_input_infos(cfg, shapes)
    assert len(infos) == 2
    for info, (b, n) in zip(infos, shapes.decode, strict=True):
        assert info[:2] == [("tokens", [b], "int64"), ("positions", [b], "int64")]
        assert len(info) == 2 + 2 * cfg.num_layers
        assert info[2] == ("k0", [b, cfg.num_kv_heads, n, cfg.head_dim], "bfloat16")
        assert info[-1][0] == f"v{cfg.num_layers - 1}"
    with pytest.raises(Exception, match="kv dtype 'int8'"):
        atom.decode_input_info(cfg, 1, 16, "int8")


def test_atom_cache_key_names_graph_shapes_dtype_npu_and_sdk() -> None:
    s = GraphShapes(decode=((1, 512), (8, 2048)), kv_dtype="bf16")
    key = atom.cache_key("fp", s, "RBLN-CA25", "0.9")
    reordered = GraphShapes(decode=((8, 2048), (1, 512)), kv_dtype="bf16")
    assert key == atom.cache_key("fp", reordered, "RBLN-CA25", "0.9")
    others = {atom.cache_key("fp2", s, "RBLN-CA25", "0.9"), atom.cache_key("fp", s, "RBLN-CA12", "0.9"),
              atom.cache_key("fp", s, "RBLN-CA25", "1.0"),
              atom.cache_key("fp", GraphShapes(decode=((1, 512),), kv_dtype="bf16"), "RBLN-CA25", "0.9"),
              atom.cache_key("fp", GraphShapes(decode=s.decode, kv_dtype="fp32"), "RBLN-CA25", "0.9")}
    assert key not in others and len(others) == 5


def test_atom_module_imports_without_the_sdk_and_names_it_when_used(engine_model) -> None:
    code = "import sys, rngd_pd.devices.atom, rngd_pd.devices.runtime; print('rebel' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.stdout.strip() == "False", out.stderr
    if "rebel" in sys.modules:
        pytest.skip("an SDK named rebel is importable here")
    with pytest.raises(DeviceUnavailableError, match=r"rebel-compiler.*--config-name cpu"):
        runtime_for(Device("atom", 0, "atom:0"), engine_model)


class FakeRebel(types.ModuleType):
    """A stand-in for rebel's compile/runtime surface: 'compiling' keeps the torch module, the
    runtime calls it. It checks only the adapter's wiring (input_info per bucket, write-back)."""

    def __init__(self, available: bool = True) -> None:
        super().__init__("rebel")
        self.available, self.compiled = available, []
        self.__version__ = "0.0-test"
        self.compile_context = types.SimpleNamespace(CompileContext=lambda **kw: kw)

    def npu_is_available(self, index: int) -> bool:
        return self.available

    def device_count(self) -> int:
        return int(self.available)

    def get_npu_name(self, index: int) -> str:
        return "RBLN-CA25"

    def compile_from_torch(self, module, input_info, **kw):
        self.compiled.append((input_info, kw))
        return types.SimpleNamespace(module=module, save=lambda path: Path(path).write_text("compiled"))

    def Runtime(self, compiled, tensor_type: str, device: int):
        assert tensor_type == "pt"
        return types.SimpleNamespace(run=lambda *xs: compiled.module(*xs))


def test_atom_runtime_decodes_like_the_cpu_through_its_adapter(engine_model, monkeypatch, tmp_path) -> None:
    import torch

    from rngd_pd.engine.prefill import PrefillEngine
    from rngd_pd.model.sampling import SamplingParams

    monkeypatch.setitem(sys.modules, "rebel", FakeRebel(available=False))
    with pytest.raises(DeviceUnavailableError, match="ATOM card 0 is not available"):
        atom.AtomRuntime(Device("atom", 0, "atom:0"), engine_model)
    fake = FakeRebel()
    monkeypatch.setitem(sys.modules, "rebel", fake)
    monkeypatch.setenv(RNGD_PD_ATOM_CACHE.name, str(tmp_path))
    rt = atom.AtomRuntime(Device("atom", 0, "atom:0"), engine_model)
    shapes = GraphShapes(decode=((2, 64),), kv_dtype="fp32")
    rt.prepare(shapes)
    (info, kw), = fake.compiled
    assert info == atom.bucket_input_infos(engine_model.config, shapes) and kw["npu"] == "RBLN-CA25"
    assert list(tmp_path.glob("decode-*.rbln"))
    with pytest.raises(DeviceUnavailableError, match="decode only"):
        rt.prefill(None)
    cpu = as_runtime(engine_model)
    ids = engine_model.tokenizer.encode("The capital of France is")
    pre = PrefillEngine(cpu, "fp32", None).prefill("k", ids, SamplingParams(max_tokens=4))
    tokens = {}
    for name, r in (("cpu", cpu), ("atom", rt)):
        cache = r.new_cache(2, 64, "fp32")
        cache.load_all(1, pre.kv)
        tok, pos, got = pre.first_token, len(ids), []
        with r.inference():
            for _ in range(4):
                host, idx = r.step_buffers(1)
                host[:, 0] = (tok, pos, 1)
                tok = int(r.decode_step(idx[0, :1], idx[1, :1], cache, idx[2, :1]).argmax(-1)[0])
                got.append(tok)
                pos += 1
        tokens[name] = got
    assert tokens["atom"] == tokens["cpu"]
    assert torch.is_tensor(rt.to_host(torch.zeros(1)))


def _conformance(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "rngd_pd.commands.device_conformance", *args],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)


def test_conformance_of_a_missing_device_says_why_and_exits_2() -> None:
    out = _conformance("atom", "--chunks", "16", "--decode", "1x32")
    assert out.returncode == 2 and "atom cannot be checked here" in out.stderr and "rebel" in out.stderr


@pytest.mark.device
def test_cuda_conformance_against_the_cpu_oracle() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip(f"{skips.NO_GPU} (torch.cuda.is_available() is False)")
    out = _conformance("cuda", "--chunks", "16,128", "--decode", "1x64,4x256", "--steps", "8")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "cuda conforms" in out.stdout


def test_devices_lists_environments_and_which_configs_load(capsys) -> None:
    import argparse
    import json

    import torch

    from rngd_pd.commands import devices

    assert devices.run(argparse.Namespace(repository=None, role="all", json=True)) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    envs = {r["environment"]: r for r in rows if "environment" in r}
    assert envs["this (.venv)"]["packages"]["torch"].startswith(torch.__version__.split("+")[0])
    rngd_env = envs[".venv-rngd"]
    assert rngd_env["packages"].get("furiosa-torch") or "make rngd-env" in rngd_env["problem"]
    configs = {r["config"]: r for r in rows if "config" in r}
    assert set(configs) == {"config.pbtxt", "rngd", "cuda", "cpu"}
    assert configs["cpu"]["loads"] and not configs["config.pbtxt"]["loads"]
    assert "rngd:" in configs["config.pbtxt"]["why_not"] and "atom:" in configs["config.pbtxt"]["why_not"]
    if not torch.cuda.is_available():
        assert not configs["cuda"]["loads"] and "CUDA" in configs["cuda"]["why_not"]


@pytest.mark.rngd
@pytest.mark.slow
def test_rngd_compile_only_conformance_takes_every_graph_through_the_furiosa_compiler() -> None:
    from rngd_pd.devices.rngd.runtime import rngd_python

    assert rngd_python() is not None, "needs the FuriosaAI environment: run `make rngd-env`"
    out = _conformance("rngd", "--compile-only", "--chunks", "16", "--decode", "1x32")
    assert out.returncode == 0, out.stdout + out.stderr
    for graph in ("prefill_layer", "prefill_head", "decode_layer", "decode_head"):
        assert f"{graph}@import" in out.stdout, out.stdout
    assert "furiosa-torch" in out.stdout


def test_rngd_compile_only_without_its_environment_names_make_rngd_env(tmp_path) -> None:
    env = {**os.environ, "RNGD_PD_RNGD_VENV": str(tmp_path / "none")}
    out = subprocess.run([sys.executable, "-m", "rngd_pd.commands.device_conformance", "rngd",
                          "--compile-only"], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert out.returncode == 2 and "make rngd-env" in out.stderr, out.stderr
