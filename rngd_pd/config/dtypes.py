"""The one table of the dtypes this project names: compute, KV cache, KV wire and graph inputs.

Our names (`bf16`, `fp16`, `fp32`) are what parameters, flags, the KV handle and the vendor graphs
say; torch's names and the bytes per element come from this table and nowhere else. Torch-free at
import: the front end and the RNGD environment (another torch) read it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rngd_pd.errors import ConfigError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Dtype:
    """One dtype: our name, torch's name, bytes per element."""

    name: str
    torch_name: str
    itemsize: int


DTYPES: dict[str, Dtype] = {d.name: d for d in (
    Dtype("bf16", "bfloat16", 2),
    Dtype("fp16", "float16", 2),
    Dtype("fp32", "float32", 4),
)}
AUTO = "auto"                        # compute dtype measured at load (rngd_pd.devices.kernels)
KV_DTYPES = tuple(DTYPES)            # what the KV cache and its wire may be
COMPUTE_DTYPES = ("bf16", "fp32")    # what weights and compute may be
COMPUTE_CHOICES = (AUTO, *COMPUTE_DTYPES)  # what the dtype parameter and `rngd-pd serve --dtype` accept
_BY_TORCH_NAME = {d.torch_name: d.name for d in DTYPES.values()}


def short_dtype(dtype: Any) -> str:
    """Our name of a dtype given by our name, torch's name or a torch dtype; any other dtype by
    torch's name (int64)."""
    text = str(dtype).removeprefix("torch.")
    return _BY_TORCH_NAME.get(text, text)


def torch_name(name: str) -> str:
    """Torch's name of a dtype given by our name; any other name (torch's own, int64) as given."""
    return DTYPES[name].torch_name if name in DTYPES else name


def lookup(name: Any, allowed: tuple[str, ...] = KV_DTYPES) -> Dtype:
    """The table's row for `name` (ours, torch's or a torch dtype); ConfigError naming the choices."""
    short = short_dtype(name)
    if short not in allowed:
        raise ConfigError(f"dtype {name!r} is not one of {', '.join(allowed)}")
    return DTYPES[short]


def torch_dtype(name: Any) -> torch.dtype:
    """The torch dtype of a name (bf16, fp16, fp32) or a torch dtype."""
    import torch  # here: heavy, and the front end and the status tools never need it

    if isinstance(name, torch.dtype):
        return name
    return getattr(torch, lookup(name).torch_name)
