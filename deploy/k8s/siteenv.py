"""Site variables for deploy/k8s: deploy/k8s/cluster.local.env, with exported variables winning.

cluster.local.env is a copy of the committed cluster.example.env, filled in and ignored by git.
Lines are NAME=VALUE (`export NAME=VALUE` and quoted values too); `#` starts a comment line; an
empty value counts as unset.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOCAL_ENV = HERE / "cluster.local.env"
EXAMPLE_ENV = HERE / "cluster.example.env"
_LINE = re.compile(r"^(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


class SiteConfigError(RuntimeError):
    """A malformed env file or a variable that must be set and is not (the message names it)."""


def parse_env_file(path: Path) -> dict[str, str]:
    values: dict[str, str] = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            raise SiteConfigError(f"{path}:{n}: expected NAME=VALUE, got {raw!r}")
        name, value = m.groups()
        try:
            parts = shlex.split(value, comments=True)
        except ValueError as exc:
            raise SiteConfigError(f"{path}:{n}: {exc}") from None
        values[name] = " ".join(parts)
    return values


def site_env(env_file: Path | None = None, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The file's variables overlaid by the environment's (exported wins); empty values dropped."""
    environ = os.environ if environ is None else environ
    path = LOCAL_ENV if env_file is None else env_file
    merged = parse_env_file(path) if path.exists() else {}
    merged.update(environ)
    return {k: v for k, v in merged.items() if v != ""}


def where_to_set(env_file: Path | None = None) -> str:
    path = LOCAL_ENV if env_file is None else env_file
    hint = f"export it, or set it in {_rel(path)}"
    if not path.exists():
        hint += f" (copy {_rel(EXAMPLE_ENV)} there first)"
    return hint


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)
