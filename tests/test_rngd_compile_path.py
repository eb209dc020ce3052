"""One compile path for RNGD (issue 27, item 1): serving's card worker, `--compile-only`, CI and
`rngd-pd compile` reach the furiosa compiler through one function, `rngd.graphs.compile_graph`,
with one CompilerConfig; `rngd-pd compile` writes artifacts a second run and a card's load reuse
without compiling.

The structural checks read the source (no SDK needed); the `rngd` ones run the real furiosa
compiler in `.venv-rngd` on the smallest configured graph (`decode_head_b8`).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rngd_pd.devices.rngd import artifacts as A
from rngd_pd.devices.rngd import env as rngd_envs
from rngd_pd.devices.rngd import graphs as rngd_graphs
from rngd_pd.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
GRAPHS = ROOT / "rngd_pd" / "devices" / "rngd" / "graphs.py"
COMPILER_CALLS = {("compiler", "compile"), ("compiler", "lower"), ("compiler", "import_dfg"),
                  ("CompileModule", "from_exported"), ("CompileModule", "from_module"),
                  ("compiler", "compile_gm")}


def test_search_is_bounded_by_default_and_full_on_request():
    assert A.parse_search(None) == A.parse_search("") == A.DEFAULT_SEARCH == 16
    assert A.parse_search("full") is None and A.parse_search(" FULL ") is None
    assert A.parse_search("4") == 4 and A.search_label(None) == "full" and A.search_label(8) == "8"
    for bad in ("0", "-3", "fast"):
        with pytest.raises(ConfigError, match="use `full`"):
            A.parse_search(bad)
    assert A.CompileOptions().args() == ["--search", "16"]
    assert A.CompileOptions(None, "/a").args() == ["--search", "full", "--artifacts", "/a"]


def _key(**kw):
    base = {"graph": "decode_head_b8", "shape": "B=8", "dtype": "bf16", "kv_dtype": "bf16", "search": "16",
            "compiler": "fc43f6a779", "model": "m" * 64, "code": "c" * 64}
    return A.ArtifactKey(**{**base, **kw})


def test_artifact_store_finds_only_whole_artifacts_of_the_same_key(tmp_path):
    store = A.ArtifactStore(tmp_path / "art")
    key = _key()
    assert store.find(key) is None
    path = store.save(key, b"\x01binary", {"seconds": {"compile": 1.0}})
    assert path.name == f"decode_head_b8.{key.digest}.runnable" and oct(path.stat().st_mode)[-3:] == "644"
    data, info = store.read(key)
    assert data == b"\x01binary" and info["bytes"] == 7 and info["seconds"] == {"compile": 1.0}
    for other in (_key(search="full"), _key(dtype="fp32"), _key(compiler="other"), _key(code="d" * 64)):
        assert other.digest != key.digest and store.find(other) is None
    path.write_bytes(b"\x01binarZ")  # same size, other bytes: read refuses it
    with pytest.raises(ConfigError, match="sha256"):
        store.read(key)
    path.write_bytes(b"\x01bin")  # a partial copy: find does not take it
    assert store.find(key) is None
    assert [r["key"]["graph"] for r in store.listing()] == ["decode_head_b8"]


def _calls(tree: ast.AST) -> dict[str, set[str]]:
    """{function name: names it calls (bare names and attribute names)}, nested functions folded
    into the function that defines them."""
    out: dict[str, set[str]] = {}
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        names = out.setdefault(fn.name, set())
        for call in (c for c in ast.walk(fn) if isinstance(c, ast.Call)):
            f = call.func
            names.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return out


def _enclosing(tree: ast.AST) -> dict[int, str]:
    """id(node) -> the name of the outermost function holding it (ast.walk visits outer first)."""
    owner: dict[int, str] = {}
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        for node in ast.walk(fn):
            owner.setdefault(id(node), fn.name)
    return owner


def _source_of(name: str) -> str:
    text = GRAPHS.read_text()
    fn = next(n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef) and n.name == name)
    return ast.get_source_segment(text, fn) or ""


def test_one_function_calls_the_furiosa_compiler():
    """Structural: in the whole package the furiosa compiler (compile, lower, import_dfg,
    CompileModule.from_*) is called in `compile_graph` alone, and serving (`serve` ->
    `card_builder` -> `build_graph`), `--compile-only` / CI and `rngd-pd compile` (`compile_one`,
    which `run_child` runs as `--one`; rngd.runtime's compile_check and compile_artifacts start
    graphs' `--compile-only` loop) all reach it."""
    found = []
    for path in sorted((ROOT / "rngd_pd").rglob("*.py")):
        tree = ast.parse(path.read_text())
        owner = _enclosing(tree)
        for call in (c for c in ast.walk(tree) if isinstance(c, ast.Call)):
            f = call.func
            named = isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
            if named and (f.value.id, f.attr) in COMPILER_CALLS:
                found.append((path.name, owner.get(id(call)), f"{f.value.id}.{f.attr}"))
    assert {(p, fn) for p, fn, _ in found} == {("graphs.py", "compile_graph")}, found
    assert {c for _, _, c in found} == {"compiler.import_dfg", "compiler.lower", "compiler.compile"}
    calls = _calls(ast.parse(GRAPHS.read_text()))
    assert "compiler_config" in calls["compile_graph"]  # the one CompilerConfig
    assert "compile_graph" in calls["build_graph"]
    assert "build_graph" in calls["card_builder"] and "card_builder" in calls["serve"]
    assert {"build_graph", "compile_graph"} <= calls["compile_one"]
    assert "compile_one" in calls["main"] and "run_child" in calls["main"]
    assert '"--one"' in _source_of("run_child")
    runtime = (ROOT / "rngd_pd" / "devices" / "rngd" / "runtime.py").read_text()
    assert runtime.count('"--compile-only"') == 2  # compile_check (CI, --compile-only), compile_artifacts
    cmd = (ROOT / "rngd_pd" / "commands" / "compile.py").read_text()
    assert "compile_artifacts(" in cmd
    # the config every compile uses: bounded by default, full on request
    src = _source_of("compiler_config")
    assert 'kw["max_num_unique_shapes"] = search' in src and "search: int | None = DEFAULT_SEARCH" in src


def test_the_card_worker_builds_each_graph_once_through_its_builder():
    """The CardWorker asks its builder (on a card `card_builder`) for each graph a prepare needs,
    once per name, with the KV dtype prepare names."""
    import torch

    from rngd_pd.model import load_model

    loaded = load_model(None, dtype=torch.float32, progress=False)
    asked = []

    def build(spec, kv):
        asked.append((spec.name, kv))
        return lambda *a: None

    worker = rngd_graphs.CardWorker(loaded.model, torch.device("cpu"), build)
    msg = {"op": "prepare", "chunks": [16], "past": [], "decode": [[2, 64]], "kv_dtype": "bf16"}
    assert all(r["ok"] for r in worker.handle(msg, [])[0]["rows"])
    worker.handle(msg, [])
    assert asked == [(n, torch.bfloat16) for n in
                     ("prefill_layer_t16", "prefill_head_t16", "decode_layer_b2_l64", "decode_head_b2")]


# ---------------------------------------------------------------- with the real compiler (.venv-rngd)


def _ready_or_skip():
    from tests.test_devices_rngd import rngd_missing

    why = rngd_missing()
    if why and os.environ.get("CI") == "true":
        pytest.fail(f"CI must check the RNGD compile path: {why}")
    if why:
        pytest.skip(why)


def _compile(out: Path) -> tuple[list[dict], str, float]:
    cmd = [sys.executable, "-m", "rngd_pd.cli", "compile", "--config", "rngd", "--out", str(out),
           "--only", "decode_head_b8", "--json"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=2400)
    secs = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")], proc.stderr, secs


# run in .venv-rngd: the card worker's builder (what `serve` builds, here with the CPU as its device:
# the load onto a card is the one step left out) and compile_one (--compile-only, CI and
# rngd-pd compile's child), with rngd.graphs.compile_graph recorded
_CARD_LOAD = textwrap.dedent("""
    import argparse, json, sys, torch
    from rngd_pd.devices.rngd import graphs as G
    from rngd_pd.devices.rngd.artifacts import CompileOptions
    from rngd_pd.model import load_model
    calls, real = [], G.compile_graph
    def recorded(ep, spec, search=16, **kw):
        calls.append([spec.name, search, kw.get("stage", "compile")])
        return real(ep, spec, search, **kw)
    G.compile_graph = recorded
    art, empty = sys.argv[1], sys.argv[2]
    model = load_model(None, dtype=torch.bfloat16, progress=False).model
    spec, logs, out = G._spec_by_name("decode_head_b8"), [], {}
    m = G.card_builder(model, torch.device("cpu"), CompileOptions(16, art), logs.append)(spec, torch.bfloat16)
    out["from_artifacts"] = {"calls": list(calls), "type": type(m).__name__, "logs": list(logs)}
    calls.clear()
    G.card_builder(model, torch.device("cpu"), CompileOptions(16, empty), logs.append)(spec, torch.bfloat16)
    out["missing"] = {"calls": list(calls), "logs": list(logs)}
    calls.clear()
    ns = argparse.Namespace(dtype="bf16", kv_dtype="bf16", stage="import", search=16, no_cache=False,
                            tactic_hint=None, model=None, artifacts="")
    row = G.compile_one(spec, ns)
    out["compile_only"] = {"calls": list(calls), "ok": row["ok"]}
    print(json.dumps(out))
""")


@pytest.mark.rngd
@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_rngd_pd_compile_writes_artifacts_that_a_rerun_and_the_card_load_reuse(tmp_path):
    """`rngd-pd compile` compiles decode_head_b8 (the smallest configured graph) into DIR; a second
    run compiles nothing; the card worker's builder loads it from DIR without calling the
    compiler, and with DIR missing it compiles through compile_graph (search 16), says so and
    saves it; `--compile-only`'s compile_one goes through compile_graph too."""
    _ready_or_skip()
    art = tmp_path / "art"
    rows, err, first = _compile(art)
    assert [(r["name"], r["ok"], r.get("source"), r["search"]) for r in rows] == [
        ("decode_head_b8", True, "compiled", "16")], err[-2000:]
    assert "1 compiled, 0 already in" in err and "%" in err  # the progress bar
    files = sorted(p.suffix for p in art.iterdir())
    assert files == [".json", ".runnable"]
    rows, err, again = _compile(art)
    assert [(r["name"], r["source"], r["seconds"]["total"]) for r in rows] == [
        ("decode_head_b8", "artifacts", 0.0)]
    assert "0 compiled, 1 already in" in err
    print(f"first run {first:.0f} s, second {again:.0f} s")

    python = rngd_envs.rngd_python()
    proc = subprocess.run([str(python), "-c", _CARD_LOAD, str(art), str(tmp_path / "empty")],
                          capture_output=True, text=True, cwd=ROOT, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["from_artifacts"] == {"calls": [], "type": "CompileModule", "logs": []}
    assert out["missing"]["calls"] == [["decode_head_b8", 16, "compile"]]
    said = out["missing"]["logs"]
    assert "is not in the artifacts" in said[0] and "compiling it (search 16)" in said[0]
    assert "saved as" in said[1] and any((tmp_path / "empty").glob("decode_head_b8.*.runnable"))
    assert out["compile_only"] == {"calls": [["decode_head_b8", 16, "import"]], "ok": True}
