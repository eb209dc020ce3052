"""Fill the site variables (${NAME}) of manifests from deploy/k8s/cluster.local.env and print them.

    python deploy/k8s/gen_sweep.py > deploy/k8s/sweep-matrix.yaml
    python deploy/k8s/render.py deploy/k8s/sweep-matrix.yaml | kubectl apply -f -

Values come from cluster.local.env (a filled-in copy of cluster.example.env, ignored by git);
variables exported in the shell win. Every ${NAME} in the input must resolve: otherwise nothing is
printed and the exit code is 2, naming each missing variable and where to set it. `$${NAME}` stays
a literal `${NAME}`.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from siteenv import SiteConfigError, site_env, where_to_set

_VAR = re.compile(r"\$(\$?)\{([A-Za-z_][A-Za-z0-9_]*)\}")


def variables(text: str) -> list[str]:
    """The ${NAME} variables a text refers to, in order of first use ($${NAME} excluded)."""
    seen: list[str] = []
    for m in _VAR.finditer(text):
        if not m.group(1) and m.group(2) not in seen:
            seen.append(m.group(2))
    return seen


def render(text: str, values: Mapping[str, str]) -> str:
    missing = [name for name in variables(text) if name not in values]
    if missing:
        raise SiteConfigError(f"unset site variable(s) {', '.join(missing)}")
    return _VAR.sub(lambda m: "${" + m.group(2) + "}" if m.group(1) else values[m.group(2)], text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("manifests", nargs="*", type=Path, help="YAML files (default: standard input)")
    ap.add_argument("--env-file", type=Path, default=None,
                    help="site variables (default deploy/k8s/cluster.local.env)")
    args = ap.parse_args(argv)
    texts = [p.read_text() for p in args.manifests] if args.manifests else [sys.stdin.read()]
    try:
        values = site_env(args.env_file)
        out = [render(t, values) for t in texts]
    except SiteConfigError as exc:
        print(f"render: {exc}; {where_to_set(args.env_file)}", file=sys.stderr)
        return 2
    sys.stdout.write("\n---\n".join(t.rstrip("\n") for t in out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
