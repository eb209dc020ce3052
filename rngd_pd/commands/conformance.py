"""`rngd-pd conformance NAME`: the KV transport contract suite (rngd_pd.kv.conformance)."""

from __future__ import annotations

import argparse

from rngd_pd.kv.conformance import add_arguments as add
from rngd_pd.kv.conformance import run as run_suite

HELP = "run the KV transport contract suite against a registered transport"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add(p)


def run(args: argparse.Namespace) -> int:
    return run_suite(args)
