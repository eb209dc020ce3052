"""Emit the experiment sweep's Kubernetes objects: transport x decode device x batch width x sequence length.

    python deploy/k8s/gen_sweep.py > deploy/k8s/sweep-matrix.yaml          # the whole matrix (48 points)
    python deploy/k8s/gen_sweep.py --transport tcp --decode-device rngd --batch 4 --seq-len 512
    python deploy/k8s/render.py deploy/k8s/sweep-matrix.yaml | kubectl apply -f -
    kubectl -n <ns> scale deploy -l rngd-pd.ai-computing.io/sweep-point=pd-shm-atom-b8-s256 --replicas=1

The matrix is the original's: KV transport (shm, tcp, nixl-ucx) x decode device (atom, rngd) x decode
batch width (1, 4, 8, 16: parameter num_slots) x sequence length (256, 512: parameter max_len). Each
point is the chart's layout pinned to one node (${RNGD_PD_NODE}): prefill (RNGD), decode (ATOM, or
RNGD with model config `rngd`) and gateway Deployments with their Services, plus a kv relay for tcp and
nixl-ucx. One card per pod, so every Deployment uses `strategy: Recreate`, and every point starts
at --replicas (default 0): applying the matrix holds no card until a point is scaled up.

The pods run this checkout from the node (${RNGD_PD_HOME}, mounted at the same path, its .venv's
rngd-pd) in ${RNGD_PD_IMAGE}, on the model ${RNGD_PD_MODEL}, in namespace ${RNGD_PD_NAMESPACE};
render.py fills these in from cluster.local.env. A relay secret is read from the Secret
rngd-pd-sweep-kv (key secret) when it exists.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import yaml

TRANSPORTS = ("shm", "tcp", "nixl-ucx")
DECODE_DEVICES = ("atom", "rngd")
BATCH_WIDTHS = (1, 4, 8, 16)
SEQ_LENS = (256, 512)

RESOURCES = {"rngd": "furiosa.ai/rngd", "atom": "rebellions.ai/ATOM"}
DECODE_CONFIG = {"atom": None, "rngd": "rngd"}
HTTP, GRPC, METRICS, OPENAI, RELAY = 8000, 8001, 8002, 9000, 7700
CHECKPOINT = "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint"
POD_RESOURCES = "/var/lib/kubelet/pod-resources"
SWEEP_LABEL = "rngd-pd.ai-computing.io/sweep-point"
NS = "${RNGD_PD_NAMESPACE}"
HOME = "${RNGD_PD_HOME}"
MODEL = "${RNGD_PD_MODEL}"


@dataclass(frozen=True)
class Point:
    transport: str
    decode_device: str
    batch: int
    seq_len: int

    @property
    def name(self) -> str:
        return f"pd-{self.transport}-{self.decode_device}-b{self.batch}-s{self.seq_len}"

    @property
    def relay(self) -> bool:
        return self.transport in ("tcp", "nixl-ucx")


def matrix(transports: Iterable[str] = TRANSPORTS, decode_devices: Iterable[str] = DECODE_DEVICES,
           batches: Iterable[int] = BATCH_WIDTHS, seq_lens: Iterable[int] = SEQ_LENS) -> list[Point]:
    return [Point(*p) for p in itertools.product(transports, decode_devices, batches, seq_lens)]


def _labels(point: Point, role: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "rngd-pd-sweep", "app.kubernetes.io/component": role,
            SWEEP_LABEL: point.name, "rngd-pd.ai-computing.io/kv-transport": point.transport,
            "rngd-pd.ai-computing.io/decode-device": point.decode_device,
            "rngd-pd.ai-computing.io/batch": str(point.batch),
            "rngd-pd.ai-computing.io/seq-len": str(point.seq_len)}


def _meta(point: Point, role: str) -> dict:
    return {"name": f"{point.name}-{role}", "namespace": NS, "labels": _labels(point, role)}


def _probe(path: str, period: int, failures: int) -> dict:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period,
            "failureThreshold": failures, "timeoutSeconds": 5}


def _serve_args(point: Point, role: str) -> list[str]:
    args = ["serve", "--role", role, "--host", "0.0.0.0", "--http-port", str(HTTP), "--grpc-port", str(GRPC),
            "--metrics-port", str(METRICS), "--openai-port", str(OPENAI if role == "gateway" else -1),
            "--kv-transport", point.transport, "--model", MODEL, "--param", f"max_len={point.seq_len}"]
    if role == "decode":
        args += ["--param", f"num_slots={point.batch}"]
        if DECODE_CONFIG[point.decode_device]:
            args += ["--config-name", DECODE_CONFIG[point.decode_device]]
    if role == "gateway":
        args += ["--prefill-url", f"{point.name}-prefill:{GRPC}",
                 "--decode-url", f"{point.name}-decode:{GRPC}"]
    return [*args, "--status-file", "/run/rngd-pd/status.json"]


def _env(point: Point, role: str, device: str | None) -> list[dict]:
    env: list[dict] = [
        {"name": "AIRM_KV_TRANSPORT", "value": point.transport},
        {"name": "AIRM_METRICS_PORT", "value": str(METRICS)},
        {"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
    ]
    if point.transport == "shm" and role != "gateway":
        env.append({"name": "PD_SHM_ROOT", "value": f"/dev/shm/rngd-pd-sweep/{point.name}"})
    if point.relay:
        addr = f"{point.name}-kv-relay.{NS}.svc:{RELAY}"
        env += [{"name": "AIRM_KV_TCP_ADDR", "value": addr}, _secret_env()]
    if device:
        env.append({"name": "RNGD_PD_KUBELET_CHECKPOINT", "value": CHECKPOINT})
    return env


def _secret_env() -> dict:
    return {"name": "AIRM_KV_TCP_SECRET",
            "valueFrom": {"secretKeyRef": {"name": "rngd-pd-sweep-kv", "key": "secret", "optional": True}}}


def _deployment(point: Point, role: str, replicas: int, container: dict, volumes: list[dict],
                affinity: dict | None = None) -> dict:
    spec: dict = {"nodeSelector": {"kubernetes.io/hostname": "${RNGD_PD_NODE}"}}
    if affinity:
        spec["affinity"] = affinity
    spec.update({"terminationGracePeriodSeconds": 60, "containers": [container], "volumes": volumes})
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(point, role),
        "spec": {
            "replicas": replicas,
            "strategy": {"type": "Recreate"},  # one card per pod: never two pods on one card
            "progressDeadlineSeconds": 7200,
            "selector": {"matchLabels": {SWEEP_LABEL: point.name, "app.kubernetes.io/component": role}},
            "template": {"metadata": {"labels": _labels(point, role)}, "spec": spec},
        },
    }


def _serving(point: Point, role: str, replicas: int) -> dict:
    device = {"prefill": "rngd", "decode": point.decode_device}.get(role)
    ports = [{"name": "http", "containerPort": HTTP}, {"name": "grpc", "containerPort": GRPC},
             {"name": "metrics", "containerPort": METRICS}]
    if role == "gateway":
        ports.append({"name": "openai", "containerPort": OPENAI})
    mounts = [{"name": "home", "mountPath": HOME, "readOnly": True},
              {"name": "model", "mountPath": MODEL, "readOnly": True},
              {"name": "run", "mountPath": "/run/rngd-pd"}, {"name": "dshm", "mountPath": "/dev/shm"}]
    volumes = [{"name": "home", "hostPath": {"path": HOME, "type": "Directory"}},
               {"name": "model", "hostPath": {"path": MODEL}},
               {"name": "run", "emptyDir": {}},
               {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}]
    if point.transport == "shm" and role != "gateway":
        shm = f"/dev/shm/rngd-pd-sweep/{point.name}"
        mounts.append({"name": "kv-shm", "mountPath": shm})
        volumes.append({"name": "kv-shm", "hostPath": {"path": shm, "type": "DirectoryOrCreate"}})
    resources: dict = {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "64Gi"}}
    if device:
        resources["requests"][RESOURCES[device]] = 1
        resources["limits"][RESOURCES[device]] = 1
        mounts += [{"name": "kubelet-checkpoint", "mountPath": CHECKPOINT, "readOnly": True},
                   {"name": "pod-resources", "mountPath": POD_RESOURCES, "readOnly": True}]
        volumes += [{"name": "kubelet-checkpoint", "hostPath": {"path": CHECKPOINT, "type": "File"}},
                    {"name": "pod-resources", "hostPath": {"path": POD_RESOURCES, "type": "Directory"}}]
    container = {
        "name": role, "image": "${RNGD_PD_IMAGE}", "workingDir": HOME,
        "command": [f"{HOME}/.venv/bin/rngd-pd"], "args": _serve_args(point, role),
        "env": _env(point, role, device), "ports": ports,
        "startupProbe": _probe("/v2/health/ready", 10, 360),
        "readinessProbe": _probe("/v2/health/ready", 5, 2),
        "livenessProbe": _probe("/v2/health/live", 15, 40),
        "resources": resources, "volumeMounts": mounts,
    }
    return _deployment(point, role, replicas, container, volumes)


def _service(point: Point, role: str, ports: list[tuple[str, int]]) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(point, role),
            "spec": {"selector": {SWEEP_LABEL: point.name, "app.kubernetes.io/component": role},
                     "ports": [{"name": n, "port": p, "targetPort": n} for n, p in ports]}}


def _relay(point: Point, replicas: int) -> dict:
    container = {
        "name": "kv-relay", "image": "${RNGD_PD_IMAGE}", "workingDir": HOME,
        "command": [f"{HOME}/.venv/bin/rngd-pd"],
        "args": ["kv-relay", "--host", "0.0.0.0", "--port", str(RELAY), "--max-mb", "8192"],
        "env": [_secret_env()], "ports": [{"name": "relay", "containerPort": RELAY}],
        "readinessProbe": {"tcpSocket": {"port": "relay"}, "periodSeconds": 5},
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "10Gi"}},
        "volumeMounts": [{"name": "home", "mountPath": HOME, "readOnly": True}],
    }
    return _deployment(point, "kv-relay", replicas, container,
                       [{"name": "home", "hostPath": {"path": HOME, "type": "Directory"}}])


def objects(point: Point, replicas: int = 0) -> Iterator[dict]:
    yield _service(point, "prefill", [("grpc", GRPC), ("http", HTTP)])
    yield _service(point, "decode", [("grpc", GRPC), ("http", HTTP)])
    yield _service(point, "gateway", [("openai", OPENAI), ("http", HTTP), ("grpc", GRPC)])
    if point.relay:
        yield _service(point, "kv-relay", [("relay", RELAY)])
        yield _relay(point, replicas)
    for role in ("prefill", "decode", "gateway"):
        yield _serving(point, role, replicas)


def dump(points: Iterable[Point], replicas: int = 0) -> str:
    header = ("# Generated by deploy/k8s/gen_sweep.py; deploy/k8s/render.py fills in the site variables.\n"
              "# Not committed: python deploy/k8s/gen_sweep.py > deploy/k8s/sweep-matrix.yaml\n")
    docs = [obj for p in points for obj in objects(p, replicas)]
    return header + yaml.safe_dump_all(docs, sort_keys=False, explicit_start=True, width=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transport", action="append", choices=TRANSPORTS, help="repeatable (default: all)")
    ap.add_argument("--decode-device", action="append", choices=DECODE_DEVICES,
                    help="repeatable (default: all)")
    ap.add_argument("--batch", action="append", type=int, help=f"repeatable (default: {BATCH_WIDTHS})")
    ap.add_argument("--seq-len", action="append", type=int, help=f"repeatable (default: {SEQ_LENS})")
    ap.add_argument("--replicas", type=int, default=0, help="replicas of every Deployment (default 0)")
    ap.add_argument("--list", action="store_true", help="print the point names only")
    args = ap.parse_args(argv)
    if any(b < 1 for b in args.batch or ()) or any(s < 16 for s in args.seq_len or ()):
        ap.error("--batch must be >= 1 and --seq-len >= 16")
    points = matrix(args.transport or TRANSPORTS, args.decode_device or DECODE_DEVICES,
                    args.batch or BATCH_WIDTHS, args.seq_len or SEQ_LENS)
    if args.list:
        print("\n".join(p.name for p in points))
    else:
        sys.stdout.write(dump(points, args.replicas))
    return 0


if __name__ == "__main__":
    sys.exit(main())
