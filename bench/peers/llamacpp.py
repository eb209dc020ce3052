"""Peer: llama.cpp's OpenAI-compatible server (llama-cpp-python[server]) on the same GGUF.

llama-cpp-python compiles llama.cpp from source (many minutes on 2 cores), so it lives in its own
virtual environment, bench/.peers-venv (git-ignored), installed only when the sweep asks for this
peer, at the lowest CPU priority and one compile job so other work on the machine keeps its CPU:

    python bench/peers/llamacpp.py install      # idempotent; prints the venv's python
    python bench/peers/llamacpp.py argv --port 9200

Its server holds one model instance behind a lock: concurrent requests are served one at a time
(interrupt_requests=False keeps a new request from cutting off the one that is streaming).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(ROOT))

from bench.peers import process  # noqa: E402

VENV = Path(__file__).resolve().parents[1] / ".peers-venv"
PACKAGE = "llama-cpp-python[server]"
# llama.cpp options we do not need; skipping them shortens the build.
CMAKE_ARGS = (
    "-DLLAVA_BUILD=OFF -DMTMD_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON"
)


def venv_python(venv: Path = VENV) -> Path:
    return process.venv_python(venv)


def installed(venv: Path = VENV) -> bool:
    """Whether the peer venv can import llama_cpp.server."""
    return process.venv_imports(venv, "import llama_cpp.server")


def install(venv: Path = VENV, log: Path | None = None) -> Path:
    """Create the venv and build llama-cpp-python into it (nice 19, one job); returns its python."""
    if installed(venv):
        return venv_python(venv)
    if not venv_python(venv).exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": "1", "CMAKE_ARGS": CMAKE_ARGS}
    cmd = ["nice", "-n", "19", str(venv_python(venv)), "-m", "pip", "install", "-q", PACKAGE]
    print(f"building {PACKAGE} into {venv} (minutes; nice 19, 1 job)", file=sys.stderr)
    out = log.open("ab") if log else None
    try:
        subprocess.run(cmd, env=env, check=True, stdout=out, stderr=subprocess.STDOUT if out else None)
    finally:
        if out:
            out.close()
    return venv_python(venv)


def server_argv(
    gguf: Path, port: int, *, alias: str, threads: int = 2, n_ctx: int = 4096, venv: Path = VENV
) -> list[str]:
    """The command line of llama.cpp's server for the sweep (llamacpp_server.py: ignore_eos honoured)."""
    return [
        str(venv_python(venv)),
        str(Path(__file__).with_name("llamacpp_server.py")),
        "--model",
        str(gguf),
        "--alias",
        alias,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--threads",
        str(threads),
        "--n-ctx",
        str(n_ctx),
    ]


def main(argv: list[str] | None = None) -> int:
    """CLI: install the peer venv, or print the server's command line."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["install", "argv"])
    ap.add_argument("--port", type=int, default=9200)
    ap.add_argument("--model", type=Path)
    a = ap.parse_args(argv)
    if a.action == "install":
        print(install())
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.peers.hf_server import MODEL_NAME, embedded_gguf

    print(" ".join(server_argv(a.model or embedded_gguf(), a.port, alias=MODEL_NAME)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
