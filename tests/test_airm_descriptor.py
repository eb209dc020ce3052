"""ai-rm.yaml agrees with the package: entry points, metric families, the chart and the KPIs' sources."""

from __future__ import annotations

import importlib
import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DESCRIPTOR = yaml.safe_load((ROOT / "ai-rm.yaml").read_text())
SPEC = DESCRIPTOR["spec"]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
ENTRY_POINTS = PYPROJECT["project"]["entry-points"]


def provided(kind: str) -> list[dict]:
    return [p for p in SPEC["provides"] if p["kind"] == kind]


def test_component_identity() -> None:
    assert DESCRIPTOR["metadata"]["name"] == "rngd-pd" == PYPROJECT["project"]["name"]
    assert (SPEC["layer"], SPEC["kind"], SPEC["maturity"]) == ("l3-serving", "service", "experimental")
    assert SPEC["entryPoint"] in PYPROJECT["project"]["scripts"]
    assert (ROOT / SPEC["deploy"]["helmChart"] / "Chart.yaml").exists()
    assert (ROOT / SPEC["deploy"]["sweeps"]).exists()


def test_kv_transports_match_the_entry_points() -> None:
    declared = {p["name"]: p for p in provided("KVTransport")}
    group = ENTRY_POINTS["airm.kv_transports"]
    assert set(declared) == set(group) == {"shm", "tcp", "nixl-ucx", "nixl"}
    for name, p in declared.items():
        assert p["entryPointGroup"] == "airm.kv_transports"
        assert p["object"] == group[name], name
        module, _, attr = p["object"].partition(":")
        assert hasattr(importlib.import_module(module), attr), p["object"]


def test_workload_matches_the_entry_point() -> None:
    (workload,) = provided("Workload")
    assert workload["name"] == "rngd-pd" and workload["entryPointGroup"] == "airm.workloads"
    assert ENTRY_POINTS["airm.workloads"] == {"rngd-pd": workload["object"]}
    from rngd_pd import airm

    assert workload["object"] == f"{airm.run.__module__}:{airm.run.__name__}"


def _registered_families() -> dict[str, str]:
    """airm_* families the code registers (rngd_pd/wire/airm_metrics.py), with their Prometheus type."""
    source = (ROOT / "rngd_pd" / "wire" / "airm_metrics.py").read_text()
    names = set(re.findall(r'"(airm_[a-z0-9_]+)"', source))
    from rngd_pd.wire import airm_metrics

    types = {**{n: "gauge" for n in airm_metrics.GAUGES}, **{n: "histogram" for n in airm_metrics.HISTOGRAMS}}
    assert names == set(types), "every airm_* name in airm_metrics.py is a registered gauge or histogram"
    return types


def test_metrics_match_what_the_code_registers() -> None:
    (metrics,) = provided("Metrics")
    assert metrics["name"] == "airm_*"
    declared = {f["name"]: f["type"] for f in metrics["families"]}
    assert all(name.startswith("airm_") for name in declared)
    assert declared == _registered_families()
    kv = next(f for f in metrics["families"] if f["name"] == "airm_kv_transfer_ms")
    assert kv["labels"] == ["kv_transport"]


def test_kpis_point_at_things_that_exist() -> None:
    kpis = {k["name"]: k for k in SPEC["kpis"]}
    assert {"mfu", "power_efficiency", "heterogeneous_resources", "slo"} <= set(kpis)
    assert kpis["slo"]["threshold"] == {"metric": "tpot_p99_ms", "max": 150}
    families = {f["name"] for f in provided("Metrics")[0]["families"]}
    for kpi in kpis.values():
        source = kpi["source"]
        assert source in families or (ROOT / source).exists(), (kpi["name"], source)


def test_environment_names_are_the_kept_ones() -> None:
    kept = {"AIRM_KV_TRANSPORT", "PD_SHM_ROOT", "AIRM_KV_TCP_ADDR", "AIRM_KV_TCP_SECRET", "POD_UID"}
    assert kept <= set(SPEC["env"])
    source = "\n".join(p.read_text() for p in (ROOT / "rngd_pd").rglob("*.py"))
    for name in SPEC["env"]:
        assert name in source, f"{name} is declared in ai-rm.yaml but nothing in rngd_pd reads it"


def test_accelerators_match_the_chart() -> None:
    values = yaml.safe_load((ROOT / "deploy/helm/rngd-pd/values.yaml").read_text())
    devices = {d["resource"]: d for d in values["devices"].values() if d["resource"]}
    for acc in SPEC["requires"]["accelerators"]:
        assert devices[acc["resource"]]["nodeSelector"][acc["nodeLabel"]] == "true"
    roles = {r: values[r]["device"] for r in ("prefill", "decode")}
    by_resource = {values["devices"][dev]["resource"]: role for role, dev in roles.items()}
    assert {a["resource"]: a["roles"][0] for a in SPEC["requires"]["accelerators"]} == by_resource
