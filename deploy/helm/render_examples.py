"""Render every example values file into deploy/helm/rngd-pd/rendered/<example>.yaml (committed).

    python deploy/helm/render_examples.py           # write them
    python deploy/helm/render_examples.py --check   # exit 1 naming the outputs that differ

tests/test_deploy_chart.py fails when the chart's output changes without these files changing too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tools


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    args = ap.parse_args(argv)
    try:
        helm = tools.ensure_tools().helm
    except tools.ToolsUnavailable as exc:
        print(f"render_examples: {exc}", file=sys.stderr)
        return 2
    tools.RENDERED.mkdir(exist_ok=True)
    stale = []
    for example in tools.examples():
        out = tools.rendered_path(example)
        text = tools.render(helm, example)
        if args.check:
            if not out.exists() or out.read_text() != text:
                stale.append(out.relative_to(tools.ROOT))
        else:
            out.write_text(text)
            print(f"wrote {out.relative_to(tools.ROOT)}")
    known = {tools.rendered_path(e).name for e in tools.examples()}
    orphans = [p for p in tools.RENDERED.glob("*.yaml") if p.name not in known]
    for p in orphans:
        if args.check:
            stale.append(p.relative_to(tools.ROOT))
        else:
            p.unlink()
            print(f"removed {p.relative_to(tools.ROOT)} (no example of that name)")
    if stale:
        print(f"stale: {', '.join(map(str, stale))}; run {tools.REGENERATE}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
