"""deploy/k8s: the sweep generator, the site-variable renderer and the cluster benchmark's gateway check."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import time
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
SITE = {"RNGD_PD_NODE": "npu-node-1", "RNGD_PD_HOME": "/srv/rngd-pd", "RNGD_PD_IMAGE": "rngd-pd-runtime:1",
        "RNGD_PD_MODEL": "/srv/models/Llama-3.1-8B-Instruct", "RNGD_PD_NAMESPACE": "rngd-pd-sweep"}
GATEWAY_VARS = ("LLMD_GATEWAY_URL", "PD_GATEWAY")


def _load(name: str):
    sys.path.insert(0, str(K8S))
    try:
        spec = importlib.util.spec_from_file_location(f"rngd_pd_k8s_{name}", K8S / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(K8S))


gen_sweep = _load("gen_sweep")
render = _load("render")
cluster_bench = _load("cluster_bench")
siteenv = sys.modules["siteenv"]  # the module render.py and cluster_bench.py import


def run(script: str, *args: str, env: dict[str, str] | None = None, stdin: str | None = None,
        cwd: Path = ROOT) -> subprocess.CompletedProcess:
    base = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
    return subprocess.run([sys.executable, str(K8S / script), *args], capture_output=True, text=True,
                          env={**base, **(env or {})}, input=stdin, cwd=cwd, timeout=60)


def flag(args: list[str], name: str) -> str | None:
    hits = [i for i, a in enumerate(args) if a == name]
    return args[hits[-1] + 1] if hits else None


# --- gen_sweep -------------------------------------------------------------------------------------

def test_matrix_is_the_originals() -> None:
    points = gen_sweep.matrix()
    assert len(points) == 3 * 2 * 4 * 2
    assert {p.transport for p in points} == {"shm", "tcp", "nixl-ucx"}
    assert {p.decode_device for p in points} == {"atom", "rngd"}
    assert {p.batch for p in points} == {1, 4, 8, 16} and {p.seq_len for p in points} == {256, 512}
    names = [p.name for p in points]
    assert len(set(names)) == len(names)
    for name in names:  # DNS-1035, with room for the role suffix
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(f"{name}-kv-relay") <= 63


@pytest.mark.parametrize("point", gen_sweep.matrix(), ids=lambda p: p.name)
def test_each_point_is_the_charts_layout(point) -> None:
    objs = list(gen_sweep.objects(point))
    deploys = {o["metadata"]["name"].removeprefix(point.name + "-"): o
               for o in objs if o["kind"] == "Deployment"}
    services = {o["metadata"]["name"] for o in objs if o["kind"] == "Service"}
    assert set(deploys) == ({"prefill", "decode", "gateway"} | ({"kv-relay"} if point.relay else set()))
    for role, d in deploys.items():
        assert d["spec"]["strategy"] == {"type": "Recreate"} and d["spec"]["replicas"] == 0
        pod = d["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"kubernetes.io/hostname": "${RNGD_PD_NODE}"}
        (c,) = pod["containers"]
        assert c["command"] == ["${RNGD_PD_HOME}/.venv/bin/rngd-pd"]
        env = {e["name"]: e for e in c["env"]}
        if role == "kv-relay":
            assert c["args"][0] == "kv-relay"
            continue
        args = c["args"]
        assert args[:3] == ["serve", "--role", role] and flag(args, "--kv-transport") == point.transport
        assert f"max_len={point.seq_len}" in args
        assert env["AIRM_KV_TRANSPORT"]["value"] == point.transport
        assert env["POD_UID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
        assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
        assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
        requests = c["resources"]["requests"]
        if role == "decode":
            assert f"num_slots={point.batch}" in args
            assert flag(args, "--config-name") == ("rngd" if point.decode_device == "rngd" else None)
            resource = {"atom": "rebellions.ai/ATOM", "rngd": "furiosa.ai/rngd"}[point.decode_device]
            assert requests[resource] == c["resources"]["limits"][resource] == 1
        if role == "prefill":
            assert requests["furiosa.ai/rngd"] == 1 and "--config-name" not in args
        if role == "gateway":
            hosts = {flag(args, "--prefill-url").split(":")[0], flag(args, "--decode-url").split(":")[0]}
            assert hosts <= services
            assert not any("/" in k for k in requests)
        if point.relay:
            host = env["AIRM_KV_TCP_ADDR"]["value"].split(".")[0]
            assert host in services and host.endswith("-kv-relay")
            assert "PD_SHM_ROOT" not in env
        else:
            assert "AIRM_KV_TCP_ADDR" not in env
            assert ("PD_SHM_ROOT" in env) == (role != "gateway")


def test_filters_and_list() -> None:
    proc = run("gen_sweep.py", "--transport", "tcp", "--decode-device", "rngd", "--batch", "4",
               "--seq-len", "512", "--list")
    assert proc.returncode == 0 and proc.stdout.split() == ["pd-tcp-rngd-b4-s512"]
    proc = run("gen_sweep.py", "--transport", "shm", "--batch", "8", "--replicas", "1")
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    assert {d["metadata"]["labels"][gen_sweep.SWEEP_LABEL] for d in docs} == \
        {"pd-shm-atom-b8-s256", "pd-shm-atom-b8-s512", "pd-shm-rngd-b8-s256", "pd-shm-rngd-b8-s512"}
    assert all(d["spec"]["replicas"] == 1 for d in docs if d["kind"] == "Deployment")
    assert run("gen_sweep.py", "--batch", "0").returncode == 2


def test_output_is_deterministic() -> None:
    assert run("gen_sweep.py").stdout == run("gen_sweep.py").stdout


def test_rendered_sweep_validates() -> None:
    """The whole matrix, site variables filled in, against the Kubernetes schemas (strict)."""
    text = render.render(gen_sweep.dump(gen_sweep.matrix()), SITE)
    assert "${" not in text
    docs = [d for d in yaml.safe_load_all(text) if d]
    assert len(docs) == sum(len(list(gen_sweep.objects(p))) for p in gen_sweep.matrix())
    seen: set[tuple[str, str]] = set()
    for d in docs:
        assert d["metadata"]["namespace"] == "rngd-pd-sweep"
        key = (d["kind"], d["metadata"]["name"])
        assert key not in seen
        seen.add(key)
        kubernetes_validate.validate(d, "1.35.0", strict=True)


def test_matrix_file_is_ignored_by_git() -> None:
    for path in ("deploy/k8s/sweep-matrix.yaml", "deploy/k8s/cluster.local.env"):
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0, path
    assert subprocess.run(["git", "check-ignore", "-q", "deploy/k8s/cluster.example.env"],
                          cwd=ROOT).returncode == 1


# --- render.py and the site env --------------------------------------------------------------------

def test_example_env_names_every_variable_the_sweep_uses() -> None:
    example = siteenv.parse_env_file(K8S / "cluster.example.env")
    used = set(render.variables(gen_sweep.dump(gen_sweep.matrix())))
    assert used == set(SITE) and used <= set(example)
    assert {"LLMD_GATEWAY_URL", "PD_GATEWAY", "KUBECTL_CMD"} <= set(example)


def test_env_file_syntax(tmp_path: Path) -> None:
    f = tmp_path / "site.env"
    f.write_text("# comment\n\nA=1\nexport B=two words\nC=\"quoted # not a comment\"\nD='x' # trailing\nE=\n")
    assert siteenv.parse_env_file(f) == {"A": "1", "B": "two words", "C": "quoted # not a comment",
                                         "D": "x", "E": ""}
    assert siteenv.site_env(f, {"A": "exported", "E": ""}) == {"A": "exported", "B": "two words",
                                                                 "C": "quoted # not a comment", "D": "x"}
    f.write_text("not an assignment\n")
    with pytest.raises(siteenv.SiteConfigError, match=r"site\.env:1"):
        siteenv.parse_env_file(f)


def test_render_fills_from_the_file_and_exported_wins(tmp_path: Path) -> None:
    f = tmp_path / "cluster.local.env"
    f.write_text("RNGD_PD_NODE=from-file\nRNGD_PD_HOME=/home/from-file\n")
    manifest = tmp_path / "m.yaml"
    manifest.write_text("node: ${RNGD_PD_NODE}\nhome: ${RNGD_PD_HOME}\nliteral: $${KEEP}\n")
    proc = run("render.py", str(manifest), "--env-file", str(f), env={"RNGD_PD_NODE": "exported"})
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout) == {"node": "exported", "home": "/home/from-file",
                                           "literal": "${KEEP}"}
    proc = run("render.py", "--env-file", str(f), stdin="a: ${RNGD_PD_HOME}\n")
    assert proc.returncode == 0 and yaml.safe_load(proc.stdout) == {"a": "/home/from-file"}


def test_render_names_the_missing_variables(tmp_path: Path) -> None:
    manifest = tmp_path / "m.yaml"
    manifest.write_text("node: ${RNGD_PD_NODE}\nimage: ${RNGD_PD_IMAGE}\n")
    proc = run("render.py", str(manifest), "--env-file", str(tmp_path / "absent.env"),
               env={"RNGD_PD_NODE": "n"})
    assert proc.returncode == 2 and proc.stdout == ""
    assert "RNGD_PD_IMAGE" in proc.stderr and "RNGD_PD_NODE" not in proc.stderr
    assert "cluster.example.env" in proc.stderr  # the file to copy when there is none


def test_default_env_file_is_cluster_local_env() -> None:
    assert siteenv.LOCAL_ENV == K8S / "cluster.local.env"
    assert siteenv.EXAMPLE_ENV.exists()


# --- the cluster benchmark -------------------------------------------------------------------------

def test_bench_without_gateway_exits_at_once_naming_the_variable() -> None:
    if (K8S / "cluster.local.env").exists():  # a developer's own file must not make this pass
        env = siteenv.parse_env_file(K8S / "cluster.local.env")
        if any(env.get(v) for v in GATEWAY_VARS):
            pytest.skip("deploy/k8s/cluster.local.env sets a gateway here")
    t0 = time.monotonic()
    proc = run("cluster_bench.py", "--concurrency", "8", "--requests", "32")
    assert time.monotonic() - t0 < 10
    assert proc.returncode == 2 and proc.stdout == ""
    assert "LLMD_GATEWAY_URL" in proc.stderr and "PD_GATEWAY" in proc.stderr


@pytest.mark.parametrize(("values", "base"), [
    ({"LLMD_GATEWAY_URL": "http://gw.example:8080"}, "http://gw.example:8080"),
    ({"LLMD_GATEWAY_URL": "http://gw.example:8080/v1/"}, "http://gw.example:8080"),
    ({"PD_GATEWAY": "http://gw:80/v1/completions", "LLMD_GATEWAY_URL": "http://other"}, "http://gw:80"),
    ({"PD_GATEWAY": "https://gw/v1/chat/completions"}, "https://gw"),
])
def test_gateway_base(values: dict, base: str) -> None:
    assert cluster_bench.gateway_base(values) == base


@pytest.mark.parametrize(("values", "needle"), [
    ({}, "LLMD_GATEWAY_URL"),
    ({"PD_GATEWAY": "http://gw/health"}, "not a completions URL"),
    ({"LLMD_GATEWAY_URL": "gw:80"}, "not an http(s) URL"),
])
def test_gateway_refused(values: dict, needle: str) -> None:
    with pytest.raises(siteenv.SiteConfigError, match=re.escape(needle)):
        cluster_bench.gateway_base(values)


def test_bench_runs_load_gen_against_the_gateway() -> None:
    proc = run("cluster_bench.py", "--print-command", "--", "--concurrency", "4",
               env={"LLMD_GATEWAY_URL": "http://gw.example:8080"})
    assert proc.returncode == 0, proc.stderr
    argv = proc.stdout.split()
    assert argv[1].endswith("bench/load_gen.py") and (ROOT / "bench" / "load_gen.py").exists()
    assert argv[2:] == ["--url", "http://gw.example:8080", "--concurrency", "4"]
    proc = run("cluster_bench.py", "--url", "http://x", env={"LLMD_GATEWAY_URL": "http://gw"})
    assert proc.returncode == 2 and "LLMD_GATEWAY_URL" in proc.stderr
