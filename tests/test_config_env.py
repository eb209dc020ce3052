"""The one registry of environment variables (rngd_pd.config.env) and where settings came from.

Every read of the environment in rngd_pd goes through the registry, every variable is documented, the
one boolean rule holds on both ends of the relay, and parse_params remembers each value's source.
"""

from __future__ import annotations

import dataclasses
import io
import re
import tokenize
from pathlib import Path

import pytest

from rngd_pd.config import env as E
from rngd_pd.config import params
from rngd_pd.config.settings import param, parse_params, source_of
from rngd_pd.errors import ConfigError
from rngd_pd.kv.options import RelayOptions, ShmOptions, UcxOptions, options
from rngd_pd.kv.relay.server import config_from_env
from rngd_pd.stubs import loading, serving

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rngd_pd"

# The only places that touch os.environ themselves, and why: they copy the whole environment for a
# child process, or put variables in place for code that reads them itself (UCX before the first NIXL
# agent; the conformance suite giving a transport its case's environment).
CHILD_COPY = ("{**os.environ", "dict(os.environ")
ALLOWED: dict[str, tuple[str, ...]] = {
    "rngd_pd/airm.py": CHILD_COPY,
    "rngd_pd/kv/relay/proc.py": CHILD_COPY,
    "rngd_pd/serve/server.py": CHILD_COPY,
    "rngd_pd/devices/rngd/runtime.py": CHILD_COPY,
    "rngd_pd/devices/rngd/graphs.py": CHILD_COPY,
    "rngd_pd/kv/nixl/agent.py": ("os.environ.update(",),
    "rngd_pd/kv/conformance.py": ("os.environ.update(",),
    "rngd_pd/__init__.py": ("os.environ.setdefault(MKL_CBWR",),
}
ENV_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def _environment_uses(path: Path) -> list[tuple[int, str]]:
    """(line, source line) of every name token that reaches the process environment (not in strings
    or comments)."""
    text = path.read_text()
    lines = text.splitlines()
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.NAME and tok.string in ENV_NAMES:
            out.append((tok.start[0], lines[tok.start[0] - 1].strip()))
    return out


def test_every_environment_read_goes_through_the_registry() -> None:
    stray = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "rngd_pd/config/env.py":
            continue
        allowed = ALLOWED.get(rel, ())
        for line, source in _environment_uses(path):
            if not any(pattern in source for pattern in allowed):
                stray.append(f"{rel}:{line}: {source}")
    assert stray == [], "read these through rngd_pd.config.env:\n" + "\n".join(stray)


def test_the_allowed_places_still_exist() -> None:
    """A stale exception would let a new read in unseen."""
    for rel, patterns in ALLOWED.items():
        sources = [s for _, s in _environment_uses(ROOT / rel)]
        assert any(p in s for s in sources for p in patterns), rel


def test_names_are_defined_once_and_the_constant_is_the_name() -> None:
    constants = {k: v for k, v in vars(E).items() if isinstance(v, E.EnvVar)}
    assert set(constants) == set(E.REGISTRY)
    for identifier, var in constants.items():
        assert identifier == var.name
        assert E.REGISTRY[var.name] is var
        assert var.readers and set(var.readers) <= set(E.COMPONENTS), var.name
        assert var.help, var.name
        assert var.default is None or isinstance(var.default, var.type), var.name
    # A literal variable name anywhere else in the package is a second definition.
    names = "|".join(re.escape(n) for n in E.REGISTRY if len(n) > 5)
    literal = re.compile(rf"""["']({names})["']""")
    twice = [f"{p.relative_to(ROOT)}: {m.group(1)}" for p in PACKAGE.rglob("*.py")
             if p != PACKAGE / "config" / "env.py" for m in literal.finditer(p.read_text())]
    assert twice == []


def test_the_original_names_are_kept() -> None:
    """DESIGN.md: ai-rm sets these."""
    kept = {"AIRM_KV_TRANSPORT", "PD_SHM_ROOT", "AIRM_KV_TCP_ADDR", "AIRM_KV_TCP_CRC", "AIRM_KV_TCP_LOG",
            "AIRM_KV_TCP_TTL_S", "AIRM_KV_UCX_POOL_MB", "AIRM_KV_UCX_LOG", "POD_UID"}
    assert kept <= set(E.REGISTRY)


def test_every_variable_is_documented() -> None:
    docs = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    missing = []
    for var in E.REGISTRY.values():
        after = r"(?=[A-Z*<])" if var.prefix else r"(?![A-Z0-9_])"
        if not re.search(rf"(?<![A-Z0-9_]){re.escape(var.name)}{after}", docs):
            missing.append(var.name)
    assert missing == [], "add these to README.md's Configuration table or docs/serving.md"


def test_the_settings_fields_take_the_registry_default() -> None:
    for cls in (params.ServingParams, serving.PdParams, serving.TextParams, ShmOptions, RelayOptions,
                UcxOptions):
        for f in dataclasses.fields(cls):
            name = f.metadata.get("env")
            if name:
                assert f.default == E.REGISTRY[name].default, (cls.__name__, f.name)


@pytest.mark.parametrize("text", [*sorted(E.TRUE | E.FALSE), "TRUE", "Off", " yes "])
def test_the_relay_and_its_client_read_a_boolean_alike(text: str, monkeypatch) -> None:
    monkeypatch.setenv(E.AIRM_KV_TCP_LOG.name, text)
    expected = text.strip().lower() in E.TRUE
    relay = config_from_env()
    client = options(RelayOptions, "tcp", {})
    assert relay.log_blobs is client.log_blobs is expected


def test_true_turns_logging_on_in_the_relay_too(monkeypatch) -> None:
    """The bug this registry fixed: the relay took only "1" while the client took 1/true/yes/on."""
    monkeypatch.setenv("AIRM_KV_TCP_LOG", "true")
    assert config_from_env().log_blobs and options(RelayOptions, "tcp", {}).log_blobs
    assert config_from_env({"AIRM_KV_TCP_LOG": "on"}).log_blobs


def test_a_boolean_outside_the_rule_fails_on_both_ends(monkeypatch) -> None:
    monkeypatch.setenv(E.AIRM_KV_TCP_LOG.name, "maybe")
    with pytest.raises(ConfigError, match=r"\$AIRM_KV_TCP_LOG is 'maybe'"):
        config_from_env()
    with pytest.raises(ConfigError, match=r"from \$AIRM_KV_TCP_LOG is 'maybe'"):
        options(RelayOptions, "tcp", {})


def test_nixl_ucx_shares_the_relays_ttl_variable(monkeypatch) -> None:
    """No UCX name exists for it (DESIGN.md's kept names); the registry says both read it."""
    monkeypatch.setenv("AIRM_KV_TCP_TTL_S", "7.5")
    assert options(UcxOptions, "nixl-ucx", {}).ttl_s == 7.5 == config_from_env().ttl_s
    assert {E.RELAY, E.TRANSPORTS} <= set(E.AIRM_KV_TCP_TTL_S.readers)


def test_typed_reads_and_empty_means_unset() -> None:
    assert E.AIRM_KV_UCX_POOL_MB.get({}) == 1024
    assert E.AIRM_KV_UCX_POOL_MB.get({"AIRM_KV_UCX_POOL_MB": "64"}) == 64
    assert E.AIRM_KV_UCX_POOL_MB.get({"AIRM_KV_UCX_POOL_MB": ""}) == 1024
    assert E.RNGD_PD_CACHE.get({"RNGD_PD_CACHE": "/c"}) == Path("/c")
    with pytest.raises(ConfigError, match=r"\$AIRM_KV_UCX_POOL_MB is 'lots', which is not a valid int"):
        E.AIRM_KV_UCX_POOL_MB.get({"AIRM_KV_UCX_POOL_MB": "lots"})
    assert params.param_env("max_len") == "RNGD_PD_PARAM_MAX_LEN"
    assert E.UCX_.members({"UCX_TLS": "rc", "PATH": "/bin"}) == {"UCX_TLS": "rc"}


@dataclasses.dataclass(frozen=True)
class Demo:
    dtype: str = param(env=E.RNGD_PD_DTYPE)
    num_slots: int = param(8)
    chunk_size: int = param(512)
    max_len: int = param(4096)


def test_parse_params_keeps_where_each_value_came_from() -> None:
    env = {"RNGD_PD_DTYPE": "bf16", "RNGD_PD_PARAM_NUM_SLOTS": "4"}
    p = parse_params(Demo, {"chunk_size": "128", "num_slots": "2"}, env=env)
    assert (p.dtype, p.num_slots, p.chunk_size, p.max_len) == ("bf16", 4, 128, 4096)
    assert source_of(p, "dtype") == "$RNGD_PD_DTYPE"
    assert source_of(p, "num_slots") == "$RNGD_PD_PARAM_NUM_SLOTS"
    assert source_of(p, "chunk_size") == "config.pbtxt"
    assert source_of(p, "max_len") == "default"
    assert p == Demo("bf16", 4, 128)  # the sources are not a field
    assert source_of(Demo(), "dtype") == "code"
    assert "dtype='bf16' (from $RNGD_PD_DTYPE)" in params.describe(p)
    assert "num_slots=4 (from $RNGD_PD_PARAM_NUM_SLOTS)" in params.describe(p)
    assert "chunk_size=128 max_len=4096" in params.describe(p)


def test_the_load_log_names_the_dtype_source_from_what_was_parsed() -> None:
    named = parse_params(params.ServingParams, {}, env={"RNGD_PD_DTYPE": "fp32"})
    generic = parse_params(params.ServingParams, {}, env={"RNGD_PD_PARAM_DTYPE": "fp32"})
    config = parse_params(params.ServingParams, {"dtype": "fp32"}, env={})
    assert loading.dtype_source(named) == "$RNGD_PD_DTYPE (rngd-pd serve --dtype)"
    assert loading.dtype_source(generic) == "$RNGD_PD_PARAM_DTYPE"
    assert loading.dtype_source(config) == "the dtype parameter"
    assert loading.dtype_source(params.ServingParams()) == "the dtype parameter"


def test_transport_options_given_in_code_say_so(monkeypatch) -> None:
    monkeypatch.setenv("AIRM_KV_SHM_POOL_MB", "64")
    o = options(ShmOptions, "shm", "ttl_s=5", crc=False)
    assert (o.pool_mb, o.ttl_s, o.crc) == (64, 5.0, False)
    assert [source_of(o, f) for f in ("pool_mb", "ttl_s", "crc", "root")] == [
        "$AIRM_KV_SHM_POOL_MB", "config.pbtxt", "code", "default"]
