"""A model repository laid out for a test or a bench: a python-backend config.pbtxt from a ModelSpec,
and the `<name>/{config.pbtxt, configs/<variant>.pbtxt, 1/model.py}` folders tritonserver loads."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

from rngd_pd.wire.tensors import ModelSpec, TensorSpec


def config_pbtxt(spec: ModelSpec, parameters: Mapping[str, str] | None = None,
                 instances: int = 1) -> str:
    """A python-backend config.pbtxt for `spec` (tensors from the spec; parameters as strings)."""

    def tensor(t: TensorSpec, optional: bool) -> str:
        opt = " optional: true" if optional and t.optional else ""
        return f'  {{ name: "{t.name}" data_type: {t.config_dtype} dims: {list(t.dims)}{opt} }}'

    lines = [f'name: "{spec.name}"', 'backend: "python"', "max_batch_size: 0"]
    if spec.decoupled:
        lines.append("model_transaction_policy { decoupled: true }")
    lines.append("input [\n" + ",\n".join(tensor(t, True) for t in spec.inputs) + "\n]")
    lines.append("output [\n" + ",\n".join(tensor(t, False) for t in spec.outputs) + "\n]")
    lines.append(f"instance_group [ {{ count: {instances} kind: KIND_CPU }} ]")
    for key, value in (parameters or {}).items():
        lines.append(f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}')
    return "\n".join(lines) + "\n"


def write_model(repository: Path, name: str, model_py: Path, config: str,
                variants: Mapping[str, str] | None = None) -> Path:
    """Lay out `<repository>/<name>/{config.pbtxt, configs/<variant>.pbtxt, 1/model.py}`."""
    root = repository / name
    (root / "1").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(model_py, root / "1" / "model.py")
    (root / "config.pbtxt").write_text(config)
    for variant, text in (variants or {}).items():
        (root / "configs").mkdir(exist_ok=True)
        (root / "configs" / f"{variant}.pbtxt").write_text(text)
    return root
