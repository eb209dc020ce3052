"""The transport registry: names, default, rm_core, source-tree fallback, laziness, no fallbacks."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from rngd_pd.errors import ConfigError
from rngd_pd.kv import registry
from rngd_pd.kv.fenced import FencedTransport
from rngd_pd.kv.shm.transport import ShmTransport


@pytest.fixture(autouse=True)
def fresh_cache():
    registry._cache.clear()
    yield
    registry._cache.clear()


def test_entry_points_declared():
    assert {"shm", "tcp", "nixl-ucx", "nixl"} <= set(registry.known_names())


def test_unknown_name_lists_known(monkeypatch):
    with pytest.raises(KeyError) as e:
        registry.load_transport("carrier-pigeon")
    for name in ("shm", "tcp", "nixl-ucx", "nixl"):
        assert name in str(e.value)


def test_serving_refuses_nixl_naming_nixl_ucx_and_the_library_keeps_it():
    assert "nixl" in registry.known_names() and "nixl" not in registry.serving_names()
    assert {"shm", "tcp", "nixl-ucx"} <= set(registry.serving_names())
    with pytest.raises(ConfigError, match=r"'nixl' cannot serve: .*serve KV over NIXL with `nixl-ucx`"):
        registry.require_servable("nixl")
    with pytest.raises(ConfigError, match=r"unknown KV transport 'pigeon'; serving takes: nixl-ucx, shm, t"):
        registry.require_servable("pigeon")
    assert registry.require_servable("nixl-ucx") == "nixl-ucx"
    assert registry.transport_class("nixl").__name__ == "NixlTransport"  # its own tests still load it


def test_default_is_shm_and_env_picks(monkeypatch, tmp_path):
    monkeypatch.delenv("AIRM_KV_TRANSPORT", raising=False)
    t = registry.load_transport(root=str(tmp_path))
    assert isinstance(t, ShmTransport) and t.name == "shm"
    t.close()
    monkeypatch.setenv("AIRM_KV_TRANSPORT", "no-such")
    with pytest.raises(KeyError, match="no-such"):
        registry.load_transport()  # never a silent fallback to shm


def test_shm_resolves_from_the_source_tree_alone(monkeypatch, tmp_path):
    monkeypatch.setattr(registry.importlib.metadata, "entry_points", lambda **kw: [])
    t = registry.load_transport("shm", root=str(tmp_path))
    assert isinstance(t, ShmTransport)
    t.close()
    with pytest.raises(KeyError, match="known: shm"):
        registry.load_transport("tcp")


def test_rm_core_registry_is_used_when_importable(monkeypatch):
    calls = []

    class Dummy:
        name = "dummy"

        def __init__(self, **kw):
            self.kw = kw

        def push(self, *a): ...
        def pull(self, *a): ...

    rm_registry = types.SimpleNamespace(load=lambda group, name: calls.append((group, name)) or Dummy)
    monkeypatch.setitem(sys.modules, "rm_core", types.SimpleNamespace(registry=rm_registry))
    monkeypatch.setitem(sys.modules, "rm_core.registry", rm_registry)
    t = registry.load_transport("dummy", x=1)
    assert calls == [("airm.kv_transports", "dummy")] and t.kw == {"x": 1}


def test_copy_only_transport_comes_fenced(monkeypatch):
    class CopyOnly:
        name = "p2p"

        def plan(self, *a): ...
        def submit(self, *a): ...
        def wait(self, *a): ...
        def close(self): ...

    monkeypatch.setitem(registry.BUILTIN, "p2p", "x:y")
    monkeypatch.setattr(registry, "_import", lambda target: CopyOnly)
    monkeypatch.setattr(registry.importlib.metadata, "entry_points", lambda **kw: [])
    assert isinstance(registry.load_transport("p2p"), FencedTransport)


def test_importing_kv_imports_no_transport():
    """The protocol, the registry and the fenced adapter it wraps copy-only transports in (with the
    byte views it uses): no transport, no vendor SDK, no torch until a name is asked for."""
    code = ("import sys, rngd_pd.kv; "
            "print(sorted(m for m in sys.modules if m.startswith(('rngd_pd.kv.', 'nixl', 'torch'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    want = ["rngd_pd.kv.buffers", "rngd_pd.kv.fenced", "rngd_pd.kv.protocol", "rngd_pd.kv.registry"]
    assert out.strip() == str(want)
