"""FencedTransport: the Transport protocol on top of a copy-only transport (plan / submit / wait).

Copy-only transports (NIXL HETERO_NPU, hetero-npu-p2p's p2p) move bytes between memory tiers but
cannot store a blob under a key for another process to find. The adapter keeps the pushed bytes in
this process, plans and submits the inner copy at push time, and lets `pull` return only once the
copy's completion fence (`wait`) reports success. Prefill and decode must therefore share the process
(the coordinator of hetero-npu-p2p); from another process a pull simply times out. A failed fence is a
TransportError; nothing falls back to another path.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from rngd_pd.errors import TransportError, TransportIntegrityError, TransportTimeoutError
from rngd_pd.kv.buffers import as_bytes, as_writable_bytes
from rngd_pd.kv.protocol import CopyTransport


class FencedTransport:
    """Wraps a CopyTransport; thread-safe."""

    def __init__(self, inner: CopyTransport) -> None:
        self.inner = inner
        self.name = getattr(inner, "name", "fenced")
        self._blobs: dict[tuple[str, int], tuple[np.ndarray, Any]] = {}
        self._cond = threading.Condition()

    def push(self, key: str, index: int, data: Any) -> None:
        staged = np.frombuffer(as_bytes(data), np.uint8).copy()  # the caller may reuse `data` on return
        plan = self.inner.plan(key, index, staged)  # an unsupported route is refused here
        self.inner.submit(plan)
        with self._cond:
            self._blobs[(key, index)] = (staged, plan)
            self._cond.notify_all()

    def pull(self, key: str, index: int, out: Any, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        with self._cond:
            while (key, index) not in self._blobs:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransportTimeoutError(
                        f"blob {index} was not pushed in this process within {timeout:g} s "
                        f"({self.name} is fenced: prefill and decode must share one process)", key=key)
                self._cond.wait(remaining)
            staged, plan = self._blobs[(key, index)]
        if not self.inner.wait(plan, max(0.0, deadline - time.monotonic())):
            raise TransportError(f"{self.name}: completion fence of blob {index} did not report success "
                                 "(copy failed or timed out)", key=key)
        mv = as_writable_bytes(out)
        if len(staged) > len(mv):
            raise TransportIntegrityError(
                f"blob {index} has {len(staged)} bytes, the output buffer only {len(mv)}", key=key)
        np.frombuffer(mv, np.uint8, count=len(staged))[:] = staged
        return len(staged)

    def release(self, key: str) -> None:
        with self._cond:
            for k in [k for k in self._blobs if k[0] == key]:
                del self._blobs[k]

    def close(self) -> None:
        with self._cond:
            self._blobs.clear()
        self.inner.close()


def is_copy_only(obj: Any) -> bool:
    """True for objects speaking plan/submit/wait but not push/pull (they need the fence)."""
    return all(hasattr(obj, m) for m in ("plan", "submit", "wait")) and not hasattr(obj, "pull")
