"""model_repository/ agrees with the tensor specs, binds devices as documented, and parses its parameters."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from rngd_pd.config.params import parse_params
from rngd_pd.stubs.serving import ColocatedParams, DecodeParams, PdParams, PrefillParams, TextParams
from rngd_pd.stubs.text_models import spec_for
from rngd_pd.wire import tensors as T

REPO = Path(__file__).resolve().parents[1] / "model_repository"
MODELS = ("llm", "pd", "colocated", "preprocess", "prefill", "decode", "postprocess")
PARAMS = {"prefill": PrefillParams, "decode": DecodeParams, "colocated": ColocatedParams, "pd": PdParams,
          "preprocess": TextParams, "postprocess": TextParams}
CONFIGS = sorted(p for m in MODELS for p in [REPO / m / "config.pbtxt", *(REPO / m).glob("configs/*.pbtxt")])


def _params(path: Path) -> dict[str, str]:
    return {k: v.string_value for k, v in T.load_config(path).parameters.items()}


def test_every_model_is_there_with_a_config_and_model_py() -> None:
    assert sorted(p.name for p in REPO.iterdir() if p.is_dir()) == sorted(MODELS)
    for name in MODELS:
        assert (REPO / name / "config.pbtxt").is_file()
        assert (REPO / name / "1").is_dir()
        if name != "llm":
            assert (REPO / name / "1" / "model.py").is_file()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(REPO)))
def test_config_matches_the_tensor_spec(path: Path) -> None:
    config = T.load_config(path)
    assert config.name == (path.parts[-2] if path.name == "config.pbtxt" else path.parts[-3])
    assert T.check_config(config, spec_for(config.name)) == []


@pytest.mark.parametrize("path", [p for p in CONFIGS if p.parts[-3 if "configs" in p.parts else -2] != "llm"],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_parameters_parse_into_the_models_dataclass(path: Path) -> None:
    name = T.load_config(path).name
    parse_params(PARAMS[name], {"name": name, "parameters": {k: {"string_value": v}
                                                              for k, v in _params(path).items()}}, env={})


def test_production_binding_and_variants() -> None:
    assert _params(REPO / "prefill" / "config.pbtxt")["device"] == "rngd"
    assert _params(REPO / "decode" / "config.pbtxt")["device"] == "atom"
    assert _params(REPO / "decode" / "configs" / "rngd.pbtxt")["device"] == "rngd"
    for model in ("prefill", "decode", "colocated"):
        assert _params(REPO / model / "configs" / "cpu.pbtxt")["device"] == "cpu"


def test_llm_ensemble_wires_pd_context_into_postprocess() -> None:
    config = T.load_config(REPO / "llm" / "config.pbtxt")
    steps = {s.model_name: s for s in config.ensemble_scheduling.step}
    assert list(steps) == ["preprocess", "pd", "postprocess"]
    produced = {v for s in steps.values() for v in s.output_map.values()}
    for step in steps.values():
        for tensor in step.input_map.values():
            assert tensor in produced or tensor in T.LLM.input_names, tensor
    assert set(T.LLM.output_names) <= set(steps["postprocess"].output_map.values())


@pytest.mark.parametrize("name", [m for m in MODELS if m != "llm"])
def test_model_py_is_a_thin_shim_to_an_importable_class(name: str) -> None:
    source = (REPO / name / "1" / "model.py").read_text()
    assert len(source.splitlines()) < 40
    tree = ast.walk(ast.parse(source))
    imports = [n for n in tree if isinstance(n, ast.ImportFrom) and n.module != "__future__"]
    (node,) = imports
    assert node.names[0].asname == "TritonPythonModel"
    cls = getattr(importlib.import_module(node.module), node.names[0].name)
    assert callable(getattr(cls, "execute", None)) and callable(getattr(cls, "initialize", None))


@pytest.mark.parametrize("device", ["rngd", "atom"])
def test_a_missing_npu_fails_the_load_naming_it_and_the_cpu_config(device: str) -> None:
    from rngd_pd.errors import DeviceUnavailableError
    from rngd_pd.stubs.loading import load_for

    with pytest.raises(DeviceUnavailableError, match="--model-config-name cpu"):
        load_for(PrefillParams(device=device), {"model_instance_name": "prefill_0_0"})
