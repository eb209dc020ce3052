"""e2e, beyond one host: prefill, decode and the KV relay each on a host of its own (network namespaces
joined by a bridge, veth pairs), the gateway (pd) on this one, the KV crossing hosts with tcp and
nixl-ucx through the real servers. Tokens equal to the colocated engine's. The namespaces, the bridge
and the servers go even when the test fails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rngd_pd.kv.relay.proc import start_relay
from rngd_pd.serve.server import ServerConfig, TritonServer, free_port
from rngd_pd.testing import e2e as E
from tests import skips
from tests.triton_harness import READY_TIMEOUT_S, require_tritonserver

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.long]
ROLES = ("prefill", "decode", "relay")


@dataclass(frozen=True)
class Hosts:
    """Namespace name and address of each role's host; the bridge's address is this host's."""

    names: dict[str, str]
    addrs: dict[str, str]
    gateway: str

    def prefix(self, role: str) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.names[role])


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _cannot_make_namespaces() -> str | None:
    """Why no namespaces can be made here, or None. Without root that is the one reason CI accepts
    (tests/skips.py); as root a missing `ip` or a refused namespace is a failure there."""
    root = os.geteuid() == 0
    if shutil.which("ip") is None:
        return "root, but iproute2's `ip` is not installed" if root else f"{skips.NO_NETNS}: no `ip` either"
    probe = f"rpd-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as exc:
        err = (getattr(exc, "stderr", "") or str(exc)).strip()
        return f"root, yet `ip netns add` failed: {err}" if root else f"{skips.NO_NETNS}: {err}"
    with contextlib.suppress(subprocess.CalledProcessError, OSError):
        _ip("netns", "del", probe)
    return None


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    why = _cannot_make_namespaces()
    if why:
        pytest.skip(why)
    tag = os.getpid() % 100000
    net = 20 + os.getpid() % 200  # 10.77.<net>.0/24, per test process
    bridge = f"rpdbr{tag}"
    names = {role: f"rpd-{tag}-{role}" for role in ROLES}
    addrs = {role: f"10.77.{net}.{i + 1}" for i, role in enumerate(ROLES)}
    made: list[tuple[str, ...]] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        made.append(("link", "del", bridge))
        _ip("addr", "add", f"10.77.{net}.254/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i, role in enumerate(ROLES):
            ns, outer, inner = names[role], f"rpd{tag}h{i}", f"rpd{tag}n{i}"
            _ip("netns", "add", ns)
            made.append(("netns", "del", ns))
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "master", bridge)
            _ip("link", "set", outer, "up")
            _ip("-n", ns, "addr", "add", f"{addrs[role]}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield Hosts(names, addrs, f"10.77.{net}.254")
    finally:
        for cmd in reversed(made):  # a namespace takes its end of the veth pair with it
            with contextlib.suppress(subprocess.CalledProcessError, OSError):
                _ip(*cmd)


def _server(stack: contextlib.ExitStack, models: list[str], env: dict[str, str], logs: Path,
            host: str = "127.0.0.1", prefix: tuple[str, ...] = ()) -> TritonServer:
    ports = {name: free_port("127.0.0.1") for name in ("http_port", "grpc_port", "metrics_port")}
    cfg = ServerConfig(E.subset_repository(models), "cpu", host=host, env=env, exec_prefix=prefix, **ports)
    server = TritonServer(cfg, log=logs / f"{models[0]}.log")
    stack.callback(server.stop)
    server.start()
    return server


def test_the_hosts_reach_each_other(hosts: Hosts) -> None:
    """TCP from the prefill and decode hosts to the relay host, and from here to each of them."""
    port = free_port("127.0.0.1")
    serve = ("import socket; s = socket.create_server((%r, %d)); print('up', flush=True)\n"
             "for _ in range(3):\n    c, _ = s.accept(); c.sendall(b'ok'); c.close()")
    code = serve % (hosts.addrs["relay"], port)
    listener = subprocess.Popen([*hosts.prefix("relay"), sys.executable, "-c", code], stdout=subprocess.PIPE,
                                text=True)
    try:
        assert listener.stdout is not None and listener.stdout.readline().strip() == "up"
        hello = "import socket; print(socket.create_connection((%r, %d), timeout=10).recv(2).decode())"
        for prefix in (hosts.prefix("prefill"), hosts.prefix("decode"), ()):
            out = subprocess.run([*prefix, sys.executable, "-c", hello % (hosts.addrs["relay"], port)],
                                 capture_output=True, text=True, timeout=30)
            assert out.stdout.strip() == "ok", (prefix, out.stderr)
    finally:
        listener.kill()
        listener.wait(10)


@pytest.mark.parametrize("transport", ["tcp", "nixl-ucx"])
def test_prefill_decode_and_relay_on_three_hosts_give_the_colocated_tokens(hosts: Hosts,
                                                                           transport: str) -> None:
    require_tritonserver()
    logs = Path(tempfile.mkdtemp(prefix="rngd-pd-e2e-netns-"))
    try:
        with contextlib.ExitStack() as stack:
            relay = stack.enter_context(start_relay(hosts.addrs["relay"], free_port("127.0.0.1"),
                                                    exec_prefix=hosts.prefix("relay")))
            kv_env = {"AIRM_KV_TRANSPORT": transport, "AIRM_KV_TCP_ADDR": relay.addr, "UCX_TLS": "tcp"}
            prefill = _server(stack, ["prefill"], kv_env, logs, hosts.addrs["prefill"],
                              hosts.prefix("prefill"))
            decode = _server(stack, ["decode"], kv_env, logs, hosts.addrs["decode"], hosts.prefix("decode"))
            urls = {"RNGD_PD_PREFILL_URL": f"{hosts.addrs['prefill']}:{prefill.cfg.grpc_port}",
                    "RNGD_PD_DECODE_URL": f"{hosts.addrs['decode']}:{decode.cfg.grpc_port}"}
            gateway = _server(stack, ["pd"], urls, logs)
            for server in (prefill, decode, gateway):
                server.wait_ready(READY_TIMEOUT_S)
            for text in E.PROMPTS[:3]:
                responses = E.stream_infer(gateway.grpc_url, "pd", E.pd_inputs(E.prompt_ids(text)),
                                           ("output_ids", "finish_reason"))
                assert E.ids_of(responses) == list(E.reference(text)[0]), text
    finally:
        shutil.rmtree(logs, ignore_errors=True)
