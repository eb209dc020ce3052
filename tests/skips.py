"""The only reasons a test may skip in CI (CI=true); tests/conftest.py's hooks hold every skip to them.

A skip hides a check; in CI every check the machine can run must run. What `make` installs (Triton,
transformers, helm, kubernetes-validate, the NIXL wheels, the embedded model) is therefore imported or
required by the tests, never skipped over. What is left is what no `make` target can bring to the
machine, and each such reason is written here once: the tests skip with these strings (a prefix; they
may add detail after it), and the hooks accept exactly them.

* no GPU: CI's machines have none (the `cuda` conformance, bench/device_check.sh where one is lent);
* a GPU present: the test checks the refusal seen without one;
* no root: network namespaces (tests/test_e2e_netns.py) need root or CAP_SYS_ADMIN + CAP_NET_ADMIN, and
  `make test` must not need root;
* no writable memory cgroup: tests/test_host_memory.py puts a child in a memory cgroup it makes, which
  needs root (or a delegated subtree) and a cgroup filesystem mounted read-write (containers often
  mount it read-only); the file-format checks beside it run everywhere;
* no native bf16: the oneDNN bf16 path exists only on CPUs with AVX512-BF16/AMX (some CI hosts are
  AVX2-only); the fp32 path those hosts serve with is tested everywhere.

Under CI=true any other skip fails its test (a skip in a fixture fails the test's setup, a skipped
module fails collection), and the run ends with the list of skips the allow-list accepted.
"""

from __future__ import annotations

import re

import pytest

NO_GPU = "no CUDA device visible to torch"
GPU_PRESENT = "a CUDA device is present"
NO_NETNS = "cannot create network namespaces here (needs root, or CAP_SYS_ADMIN and CAP_NET_ADMIN)"
NO_NATIVE_BF16 = "this CPU/torch has no oneDNN bf16 linears"
NO_CGROUP = "no writable memory cgroup"

ALLOWED: dict[str, str] = {
    NO_GPU: "no GPU",
    GPU_PRESENT: "a GPU is present",
    NO_NETNS: "no root for network namespaces",
    NO_NATIVE_BF16: "no native bf16 in this CPU",
    NO_CGROUP: "no root for a memory cgroup",
}

def allowed(reason: str) -> str | None:
    """The allow-list entry `reason` falls under, or None."""
    return next((why for prefix, why in ALLOWED.items() if reason.startswith(prefix)), None)


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    """The reason of a skipped report (pytest keeps it as (path, line, "Skipped: reason"))."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return re.sub(r"^Skipped: ", "", text)
