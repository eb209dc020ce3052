"""Model config parameters -> one frozen dataclass, through one shared parser.

Every model declares its parameters as a frozen dataclass whose fields carry a default, an optional
environment override and optional choices (`param(...)`). `parse_params` reads Triton's
`args["model_config"]`, converts each value to the field's type and fails with a `ConfigError` that
names the model and the parameter when a name is unknown or a value does not convert, so a typo in
config.pbtxt stops `initialize` instead of being ignored.

Environment overrides (set by `rngd-pd serve` and by ai-rm) win over config.pbtxt: `RNGD_PD_MODEL`
(model path), `AIRM_KV_TRANSPORT` (transport name), `RNGD_PD_KV_DTYPE` (KV wire dtype),
`RNGD_PD_DTYPE` (compute dtype), and for `pd`
`RNGD_PD_PREFILL_URL` / `RNGD_PD_DECODE_URL` (remote prefill/decode servers, gRPC host:port).
Any parameter can also be set with `RNGD_PD_PARAM_<NAME>` (`RNGD_PD_PARAM_MAX_LEN=512`), in every model
that has it; a named override above wins over it. `rngd-pd serve --param NAME=VALUE` sets these. The
variables, their defaults and readers are entries of rngd_pd.config.env; the dtypes come from
rngd_pd.config.dtypes.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from rngd_pd.config.dtypes import COMPUTE_CHOICES, KV_DTYPES
from rngd_pd.config.env import AIRM_KV_TRANSPORT, RNGD_PD_DTYPE, RNGD_PD_KV_DTYPE, RNGD_PD_MODEL
from rngd_pd.config.settings import (  # noqa: F401 - the shared parser, public here too
    TRITON_PARAMETERS,
    param,
    param_env,
    parse_params,
    raw_parameters,
    source_of,
)
from rngd_pd.errors import ConfigError

DEVICES = ("cpu", "cuda", "rngd", "atom")

@dataclass(frozen=True)
class ServingParams:
    """Parameters every serving model shares; models subclass it and add their own."""

    device: str = param("cpu", choices=DEVICES, help="where the instances run")
    device_ids: tuple[int, ...] = param((-1,), help="-1 = the allocated card; else one id per instance")
    torch_threads: int = param(0, help="torch intra-op threads per instance (0 = leave torch's default)")
    share_cores: bool = param(True, help="cpu: compute on the host's idle cores while the other "
                                         "instances are idle, torch_threads while they are busy "
                                         "(rngd_pd.devices.cores)")
    model_path: str | None = param(env=RNGD_PD_MODEL, help="checkpoint dir or .gguf; empty = embedded")
    kv_transport: str = param(env=AIRM_KV_TRANSPORT, help="airm.kv_transports name")
    kv_dtype: str = param(env=RNGD_PD_KV_DTYPE, choices=KV_DTYPES, help="KV wire dtype")
    kv_options: str = param("", help="the transport's options, NAME=VALUE;... (rngd_pd.kv.options), "
                                     "e.g. addr=relay.kv:9100 for tcp and nixl-ucx; environment names win")

    weight_store: bool = param(True, help="map the weights from the host's shared weight store (one "
                                          "converted copy per host for every instance; "
                                          "rngd_pd.model.store) instead of reading the checkpoint")
    rngd_search: str = param("", help="rngd: the compiler's tactic search, `full` or a bound of N unique "
                                      "shapes; empty: the bound every RNGD compile uses by default "
                                      "(rngd_pd.devices.rngd.artifacts)")
    rngd_artifacts: str = param("", help="rngd: the directory of compiled graphs (`rngd-pd compile --out`) "
                                         "the card loads; a graph missing there is compiled at load and "
                                         "saved there; empty: compile every graph at load")
    dtype: str = param(env=RNGD_PD_DTYPE, choices=COMPUTE_CHOICES,
                       help="compute dtype: auto (bf16 where the CPU/GPU computes bf16 natively, else fp32), "
                            "bf16 (serving speed) or fp32 (bit-exact with the fp32 oracle)")

    def device_id_for(self, instance: int) -> int:
        """The device id of instance number `instance` (one id for all, or one per instance)."""
        if len(self.device_ids) == 1:
            return self.device_ids[0]
        if instance >= len(self.device_ids):
            raise ConfigError(
                f"device_ids has {len(self.device_ids)} entries but instance {instance} needs one; "
                "give one id per instance (count in instance_group) or a single id"
            )
        return self.device_ids[instance]


def describe(params: Any) -> str:
    """One line `name=value ...` for the model's load log; a value from the environment says which
    variable (`dtype='bf16' (from $RNGD_PD_DTYPE)`)."""
    def one(name: str) -> str:
        source = source_of(params, name)
        return f"{name}={getattr(params, name)!r}" + (f" (from {source})" if source.startswith("$") else "")

    return " ".join(one(f.name) for f in dataclasses.fields(params))


def instance_index(instance_name: str) -> int:
    """Index of an instance within its group from Triton's `model_instance_name` (`pd_0_1` -> 1)."""
    match = re.search(r"_(\d+)$", instance_name or "")
    return int(match.group(1)) if match else 0

