"""Transport options (rngd_pd.kv.options): config.pbtxt's kv_options, the original's environment names,
values in code, in that order of strength; bad values named before anything is opened."""

from __future__ import annotations

import json

import pytest

from rngd_pd import errors
from rngd_pd.config import params
from rngd_pd.kv.options import RelayOptions, ShmOptions, UcxOptions, crc_algorithm, options, parse_kv_options
from rngd_pd.stubs.serving import transport_for


def test_config_then_environment_then_code(monkeypatch) -> None:
    monkeypatch.delenv("AIRM_KV_TCP_ADDR", raising=False)
    assert options(RelayOptions, "tcp", "addr=relay.kv:9100; crc=0").addr == "relay.kv:9100"
    monkeypatch.setenv("AIRM_KV_TCP_ADDR", "10.1.2.3:9000")  # ai-rm's variable wins over the config
    o = options(RelayOptions, "tcp", "addr=relay.kv:9100,crc=0")
    assert (o.addr, crc_algorithm(o.crc)) == ("10.1.2.3:9000", None)
    assert options(RelayOptions, "tcp", "addr=relay.kv:9100", addr="127.0.0.1:1").addr == "127.0.0.1:1"


def test_each_transport_keeps_its_environment_names(monkeypatch) -> None:
    monkeypatch.setenv("PD_SHM_ROOT", "/dev/shm/x")
    monkeypatch.setenv("AIRM_KV_SHM_POOL_MB", "64")
    monkeypatch.setenv("AIRM_KV_UCX_POOL_MB", "256")
    monkeypatch.setenv("AIRM_KV_UCX_LOG", "1")
    assert options(ShmOptions, "shm") == ShmOptions(root="/dev/shm/x", pool_mb=64)
    u = options(UcxOptions, "nixl-ucx")
    assert (u.pool_mb, u.log_blobs, u.read_ahead) == (256, True, 2)


def test_bad_options_are_named(monkeypatch) -> None:
    monkeypatch.delenv("AIRM_KV_SHM_POOL_MB", raising=False)
    with pytest.raises(errors.ConfigError, match=r"KV transport 'shm' option: parameter 'pool_mb'.*'lots'"):
        options(ShmOptions, "shm", "pool_mb=lots")
    with pytest.raises(errors.ConfigError, match=r"unknown parameter\(s\) adress"):
        options(RelayOptions, "tcp", "adress=relay:1")
    with pytest.raises(errors.ConfigError, match="NAME=VALUE"):
        parse_kv_options("addr")


def test_a_relay_address_in_config_pbtxt_reaches_the_transport(monkeypatch) -> None:
    """The model parameter kv_options builds the transport (here: a relay nobody listens on, which the
    tcp client only dials on first use)."""
    monkeypatch.delenv("AIRM_KV_TCP_ADDR", raising=False)
    values = {"kv_transport": "tcp", "kv_options": "addr=127.0.0.1:9"}
    config = json.dumps({"name": "decode", "parameters": {k: {"string_value": v} for k, v in values.items()}})
    p = params.parse_params(params.ServingParams, config, env={})
    transport = transport_for(p)
    try:
        assert transport.client.addr == ("127.0.0.1", 9)
    finally:
        transport.close()
