"""`nixl` transport: RNGD -> ATOM KV over NIXL with hetero-npu-p2p's HETERO_NPU backend plugin.

A copy-only transport (plan / submit / wait), so `load_transport("nixl")` returns it wrapped in
`FencedTransport`. The caller binds each request's live allocations first (`bind(key, NixlBinding)`);
`plan` then checks the route and builds the NIXL transfer, `submit` posts it, and `wait` is the
completion fence. Routes (those of the original rngd-pd):

    rngd -> dmabuf   RNGD device DRAM -> exported ATOM DMA-BUF   direct PCIe P2P, no host memory
    rngd -> host     RNGD device DRAM -> pinned host pages        staging leg
    host -> rngd     pinned host pages -> RNGD device DRAM        staging leg
    RNGD -> RNGD, ATOM -> anything, host -> host: refused at plan time (for RNGD -> RNGD plan the two
    staging legs yourself)

Bytes are copied, never converted, and nothing falls back to another path. The plugin and the NPUs are
absent on development machines: construction then fails saying what is missing; only the route logic
is exercised here. NIXL is imported inside this module only.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from rngd_pd.errors import DeviceUnavailableError, TransportError

BACKEND = "HETERO_NPU"
PLUGIN_HINT = (
    "the NIXL HETERO_NPU backend plugin comes from hetero-npu-p2p (libplugin_HETERO_NPU.so): build it "
    "against the installed NIXL, put it in a directory named by NIXL_PLUGIN_DIR, and run on a host with "
    "an RNGD card (and an ATOM card for the direct route). Elsewhere use AIRM_KV_TRANSPORT=shm or tcp"
)


class Tier(StrEnum):
    """Memory tiers a NIXL HETERO_NPU copy can touch."""

    RNGD = "rngd"  # FuriosaAI RNGD device DRAM (tensor data_ptr on the PE0 device path)
    DMABUF = "dmabuf"  # an exported Rebellions ATOM DMA-BUF (fd)
    HOST = "host"  # pinned host pages
    ATOM = "atom"  # ATOM device memory not exported as a DMA-BUF


ROUTES: dict[tuple[Tier, Tier], str] = {
    (Tier.RNGD, Tier.DMABUF): "direct",
    (Tier.RNGD, Tier.HOST): "staging-download",
    (Tier.HOST, Tier.RNGD): "staging-upload",
}


def plan_route(src: Tier | str, dst: Tier | str) -> str:
    """The route name for src -> dst, or TransportError saying why that route is refused."""
    src, dst = Tier(src), Tier(dst)
    if (src, dst) in ROUTES:
        return ROUTES[(src, dst)]
    if src is Tier.RNGD and dst is Tier.RNGD:
        why = "RNGD -> RNGD has no direct path: plan rngd -> host and host -> rngd as two legs"
    elif src in (Tier.ATOM, Tier.DMABUF):
        why = "ATOM memory is only ever a destination of this backend"
    elif src is Tier.HOST and dst is Tier.HOST:
        why = "host -> host is not a device copy: use the shm transport"
    else:
        why = "the HETERO_NPU backend has no such route"
    raise TransportError(f"nixl route {src.value} -> {dst.value} refused: {why}")


@dataclass
class NixlBinding:
    """The live allocations of one request: where its KV is and where it goes."""

    src: Any  # RNGD tensor (data_ptr) or host buffer
    dst: Any  # DMA-BUF fd, host buffer or RNGD tensor
    src_tier: Tier
    dst_tier: Tier
    context: dict[str, Any] = field(default_factory=dict)  # device ids, dma-buf fds, layout strides


@dataclass
class NixlPlan:
    key: str
    index: int
    route: str
    handle: Any = None


class NixlTransport:
    """CopyTransport over NIXL HETERO_NPU. One agent per process (the backend allows one per host)."""

    name = "nixl"

    def __init__(self, agent_name: str | None = None, **backend_params: str) -> None:
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as e:
            raise DeviceUnavailableError(f"NIXL is not importable ({e}); pip install nixl nixl-cu12, "
                                         f"and {PLUGIN_HINT}") from None
        name = agent_name or f"rngd-pd-nixl-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._agent = nixl_agent(name, nixl_agent_config(backends=[]))
        plugins = self._agent.get_plugin_list()
        if BACKEND not in plugins:
            raise DeviceUnavailableError(f"NIXL has no {BACKEND} backend plugin here (found: "
                                         f"{', '.join(plugins) or 'none'}); {PLUGIN_HINT}")
        self._agent.create_backend(BACKEND, dict(backend_params))
        self._agent_name = name
        self._bindings: dict[str, NixlBinding] = {}
        self._lock = threading.Lock()

    def bind(self, key: str, binding: NixlBinding) -> None:
        """Register where request `key`'s KV lives and where it must go; call before its first push."""
        plan_route(binding.src_tier, binding.dst_tier)  # refuse early
        with self._lock:
            self._bindings[key] = binding

    def plan(self, key: str, index: int, src: Any, dst: Any = None) -> NixlPlan:
        with self._lock:
            binding = self._bindings.get(key)
        if binding is None:
            raise TransportError("nixl moves bound device allocations; this request has none "
                                 "(a host-tier push is not supported: bind(key, NixlBinding(...)) first)",
                                 key=key)
        route = plan_route(binding.src_tier, binding.dst_tier)
        src_descs = self._agent.get_xfer_descs(_region(binding, "src", index), _mem_type(binding.src_tier))
        dst_descs = self._agent.get_xfer_descs(_region(binding, "dst", index), _mem_type(binding.dst_tier))
        handle = self._agent.initialize_xfer("WRITE", src_descs, dst_descs, self._agent_name,
                                             f"{key}:{index}".encode(), [BACKEND])
        return NixlPlan(key, index, route, handle)

    def submit(self, plan: NixlPlan) -> None:
        if self._agent.transfer(plan.handle) == "ERR":
            raise TransportError(f"nixl {plan.route} copy of blob {plan.index} failed to post", key=plan.key)

    def wait(self, plan: NixlPlan, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            state = self._agent.check_xfer_state(plan.handle)
            if state == "DONE":
                self._agent.release_xfer_handle(plan.handle)
                return True
            if state == "ERR" or time.monotonic() >= deadline:
                return False
            time.sleep(20e-6)

    def release(self, key: str) -> None:
        with self._lock:
            self._bindings.pop(key, None)

    def close(self) -> None:
        with self._lock:
            self._bindings.clear()


def _mem_type(tier: Tier) -> str:
    return "DRAM" if tier is Tier.HOST else "VRAM"  # HETERO_NPU maps RNGD/DMA-BUF regions as VRAM


def _region(binding: NixlBinding, side: str, index: int) -> list[tuple[int, int, int]]:
    """(address, length, device id) of blob `index` inside the bound allocation (layout from context)."""
    ctx = binding.context
    base, blob, dev = ctx[f"{side}_addr"], ctx["blob_bytes"], ctx.get(f"{side}_device", 0)
    return [(base + index * blob, blob, dev)]
