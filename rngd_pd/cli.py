"""`rngd-pd` command line: one subcommand per module in `rngd_pd.commands`, imported only when used.

Each command module exposes `HELP: str`, `add_arguments(parser)` and `run(args) -> int`. Importing
lazily keeps `rngd-pd --help` fast and lets a bare CPU machine run commands that need no torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, str] = {
    "generate": "rngd_pd.commands.generate",
    "serve": "rngd_pd.commands.serve",
    "frontend": "rngd_pd.commands.frontend",
    "kv-relay": "rngd_pd.commands.kv_relay",
    "conformance": "rngd_pd.commands.conformance",
    "device-conformance": "rngd_pd.commands.device_conformance",
    "compile": "rngd_pd.commands.compile",
    "devices": "rngd_pd.commands.devices",
    "apply-delta": "rngd_pd.commands.apply_delta",
    "swap": "rngd_pd.commands.swap",
}


def _load(name: str):
    return importlib.import_module(COMMANDS[name])


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """Build the parser; only the chosen subcommand's module is imported."""
    parser = argparse.ArgumentParser(prog="rngd-pd", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name in COMMANDS:
        if name == chosen:
            module = _load(name)
            p = sub.add_parser(name, help=module.HELP, description=module.HELP)
            module.add_arguments(p)
        else:
            sub.add_parser(name, help=f"(run `rngd-pd {name} --help`)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    return int(_load(args.command).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
