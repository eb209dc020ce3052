"""The package layers of docs/architecture.md hold: the import-linter contract in pyproject.toml passes,
fails when an arrow runs backwards, and the import graph has no cycle."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--no-cache"], cwd=root, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(root), "PATH": str(LINT.parent)})


def test_the_layer_contract_holds() -> None:
    out = _lint(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 kept, 0 broken" in out.stdout


def test_an_arrow_that_runs_backwards_breaks_the_contract(tmp_path: Path) -> None:
    """A copy of the tree where a stub imports the launcher, and the engine the stubs: both caught."""
    shutil.copytree(ROOT / "rngd_pd", tmp_path / "rngd_pd", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    for path, line in (("rngd_pd/stubs/sending.py", "import rngd_pd.serve.supervisor"),
                       ("rngd_pd/engine/request.py", "import rngd_pd.stubs.pbutils")):
        with (tmp_path / path).open("a") as f:
            f.write(f"\n{line}  # noqa\n")
    out = _lint(tmp_path)
    assert out.returncode != 0
    assert "rngd_pd.stubs.sending -> rngd_pd.serve.supervisor" in out.stdout
    assert "rngd_pd.engine.request -> rngd_pd.stubs.pbutils" in out.stdout


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    adj = {m: sorted(graph.find_modules_directly_imported_by(m) & graph.modules) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(adj):
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on_stack.add(v)
            if i < len(adj[v]):
                work.append((v, i + 1))
                w = adj[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return found


def test_no_import_cycle() -> None:
    graph = grimp.build_graph("rngd_pd", exclude_type_checking_imports=True)
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = grimp.ImportGraph()
    for a, b in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d")):
        graph.add_import(importer=a, imported=b)
    assert _cycles(graph) == [["p.a", "p.b", "p.c"]]


# The only packages imported inside functions, each for its reason; everything else is imported at the
# top of its module, so the imports show the graph.
LAZY = {
    "torch": "heavy (about a second and hundreds of MB): the front end, the text stubs, the relay and the "
             "device probes never load it",
    "furiosa": "FuriosaAI's SDK exists only in .venv-rngd (another torch and numpy)",
    "furiosa_smi": "installed only in .venv-rngd",
    "nixl": "optional wheels (the nixl extra)",
    "rebel": "Rebellions' SDK, installed only on ATOM hosts",
    "triton_python_backend_utils": "exists only inside Triton's Python stub",
    "rm_core": "ai-rm's registry, used when ai-rm is installed",
    "tritonclient": "its grpc client, only to parse config.pbtxt: the text stubs never load grpc",
    "google": "protobuf's text format, with tritonclient above",
    "transformers": "the outside reference (rngd_pd.model.reference): a test extra, loaded only by "
                    "conformance and the oracle tests, never by serving",
}


def _function_imports() -> list[tuple[str, int, str]]:
    found = []
    for path in sorted((ROOT / "rngd_pd").rglob("*.py")):
        tree = ast.parse(path.read_text())
        top = {id(node) for node in tree.body}
        guards = [node for node in tree.body
                  if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test)]
        checking = {id(n) for guard in guards for n in ast.walk(guard)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in top | checking:
                name = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                found.append((str(path.relative_to(ROOT)), node.lineno, name or ""))
    return found


def test_imports_inside_functions_are_only_the_optional_and_heavy_ones() -> None:
    bad = [f"{path}:{line}: {name}" for path, line, name in _function_imports()
           if name.split(".")[0] not in LAZY]
    assert bad == [], "import these at the top of the module (or name the reason in LAZY): " + ", ".join(bad)
