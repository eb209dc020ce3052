"""Benchmark a deployment on a cluster through its llm-d gateway (bench/load_gen.py aimed at it).

    cp deploy/k8s/cluster.example.env deploy/k8s/cluster.local.env   # set LLMD_GATEWAY_URL there
    python deploy/k8s/cluster_bench.py --concurrency 8 --requests 32 --prompt-tokens 256 --max-tokens 64
    python deploy/k8s/cluster_bench.py --print-command -- --rate 2 --requests 40

The gateway comes from PD_GATEWAY (a full completions URL) or LLMD_GATEWAY_URL (the gateway's base
URL), exported or in cluster.local.env (exported wins). With neither set it exits at once (code 2)
naming the variable to set; it never falls back to a local server. Every other argument goes to
bench/load_gen.py unchanged.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from siteenv import SiteConfigError, site_env, where_to_set  # noqa: E402

LOAD_GEN = HERE.parents[1] / "bench" / "load_gen.py"
SUFFIXES = ("/v1/chat/completions", "/v1/completions")


def gateway_base(values: Mapping[str, str]) -> str:
    """The gateway's base URL (what load_gen's --url takes); SiteConfigError naming what to set."""
    if full := values.get("PD_GATEWAY"):
        for suffix in SUFFIXES:
            if full.rstrip("/").endswith(suffix):
                return full.rstrip("/")[: -len(suffix)]
        raise SiteConfigError(f"PD_GATEWAY={full!r} is not a completions URL (it ends in "
                              f"{' or '.join(SUFFIXES)}); or set LLMD_GATEWAY_URL to the base URL")
    if base := values.get("LLMD_GATEWAY_URL"):
        if not base.startswith(("http://", "https://")):
            raise SiteConfigError(f"LLMD_GATEWAY_URL={base!r} is not an http(s) URL")
        return base.rstrip("/").removesuffix("/v1")
    raise SiteConfigError("no gateway configured: set LLMD_GATEWAY_URL (the llm-d gateway's base URL, "
                          "e.g. http://<gateway-host>:<port>) or PD_GATEWAY (a full completions URL)")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    print_only = "--print-command" in args
    args = [a for a in args if a != "--print-command"]
    if args[:1] == ["--"]:
        args = args[1:]
    if any(a == "--url" or a.startswith("--url=") for a in args):
        print("cluster_bench: the URL comes from LLMD_GATEWAY_URL / PD_GATEWAY, not --url", file=sys.stderr)
        return 2
    try:
        base = gateway_base(site_env())
    except SiteConfigError as exc:
        print(f"cluster_bench: {exc}; {where_to_set()}", file=sys.stderr)
        return 2
    command = [sys.executable, str(LOAD_GEN), "--url", base, *args]
    if print_only:
        print(" ".join(command))
        return 0
    return subprocess.call(command, env=os.environ)


if __name__ == "__main__":
    sys.exit(main())
