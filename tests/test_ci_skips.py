"""CI's rule on skips (tests/conftest.py, tests/skips.py), checked on a real pytest run: a child
pytest with CI=true over a tiny test module, with this suite's conftest loaded as a plugin."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests import skips

ROOT = Path(__file__).resolve().parents[1]


PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
          "test_tiny.py"]


def _env(ci: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # hypothesis' plugin alone costs seconds per start
    return env if ci is None else {**env, "CI": ci}


def _pytest(tmp_path: Path, body: str, ci: str | None = "true") -> subprocess.CompletedProcess:
    (tmp_path / "test_tiny.py").write_text("import pytest\n\n" + body)
    return subprocess.run(PYTEST, cwd=tmp_path, env=_env(ci), capture_output=True, text=True, timeout=300)


def test_a_skip_outside_the_allow_list_fails_the_run_in_ci(tmp_path: Path) -> None:
    out = _pytest(tmp_path, "def test_x():\n    pytest.skip('tritonserver unavailable: not found')\n\n"
                            "def test_y():\n    pass\n")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "1 failed, 1 passed" in out.stdout, out.stdout
    assert "outside the allow-list of tests/skips.py: tritonserver unavailable: not found" in out.stdout


def test_the_same_skip_outside_ci_is_a_skip(tmp_path: Path) -> None:
    body = "def test_x():\n    pytest.skip('tritonserver unavailable: not found')\n"
    out = _pytest(tmp_path, body, ci=None)
    assert out.returncode == 0 and "1 skipped" in out.stdout, out.stdout + out.stderr
    assert "allow-list" not in out.stdout


def test_skips_in_fixtures_marks_and_modules_fail_too(tmp_path: Path) -> None:
    body = ("@pytest.fixture\ndef helm():\n    pytest.skip('no real helm here')\n\n"
            "def test_fixture(helm):\n    pass\n\n"
            "@pytest.mark.skipif(True, reason='not today')\ndef test_mark():\n    pass\n")
    out = _pytest(tmp_path, body)
    assert out.returncode == 1 and out.stdout.splitlines()[-1].startswith("2 errors"), out.stdout
    assert "ERROR test_tiny.py::test_fixture - skipped in CI (CI=true)" in out.stdout, out.stdout
    assert "outside the allow-list of tests/skips.py: not today" in out.stdout, out.stdout
    module = _pytest(tmp_path, "pytest.importorskip('a_module_that_is_not_installed')\n")
    assert module.returncode != 0, module.stdout
    assert "outside the allow-list" in module.stdout and "a_module_that_is_not_installed" in module.stdout


def test_allowed_skips_pass_and_are_listed(tmp_path: Path) -> None:
    body = "".join(f"def test_{i}():\n    pytest.skip({reason + ' (detail)'!r})\n\n"
                   for i, reason in enumerate(skips.ALLOWED))
    out = _pytest(tmp_path, body)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"CI skip allow-list (tests/skips.py): {len(skips.ALLOWED)} skipped" in out.stdout, out.stdout
    for i, (reason, why) in enumerate(skips.ALLOWED.items()):
        assert f"test_tiny.py::test_{i}: {why}: {reason} (detail)" in out.stdout, out.stdout


def test_the_allow_list_is_printed_when_nothing_skipped(tmp_path: Path) -> None:
    out = _pytest(tmp_path, "def test_x():\n    pass\n")
    assert out.returncode == 0 and "CI skip allow-list (tests/skips.py): 0 skipped" in out.stdout, out.stdout


def test_ci_run_fails_when_a_step_skips_outside_the_allow_list_or_selects_nothing(tmp_path: Path) -> None:
    """.ci/run as CI runs it, with `make` replaced by a script that runs each step's pytest over a
    tiny module: a disallowed skip in `make test` fails the run (CI=true comes from .ci/run), the other
    step still runs, and a step whose pytest selected nothing (exit 5) fails too."""
    (tmp_path / "bin").mkdir()
    make = tmp_path / "bin" / "make"
    make.write_text(f"#!/bin/sh\ncd {tmp_path}/$1 && exec {' '.join(PYTEST)}\n")
    make.chmod(0o755)
    for step, body in (("test", "def test_x():\n    pytest.skip('no real helm here')\n"),
                       ("test-long", "def test_w():\n    pass\n"),
                       ("test-rngd", "def test_y():\n    pass\n"),
                       ("test-vllm", "def test_z():\n    pass\n")):
        (tmp_path / step).mkdir()
        (tmp_path / step / "test_tiny.py").write_text("import pytest\n\n" + body)
    env = {**_env(None), "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run(["bash", str(ROOT / ".ci" / "run")], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "outside the allow-list of tests/skips.py: no real helm here" in out.stdout
    assert "=== make test-rngd: exit 0" in out.stdout and "=== make test-vllm: exit 0" in out.stdout
    assert "CI FAILED: make test (exit 1)" in out.stdout
    (tmp_path / "test" / "test_tiny.py").write_text("import pytest\n\n" + "def test_x():\n    pass\n")
    assert subprocess.run(["bash", str(ROOT / ".ci" / "run")], env=env, capture_output=True,
                          timeout=300).returncode == 0
    (tmp_path / "test-rngd" / "test_tiny.py").write_text("import pytest\n")  # collects no test
    out = subprocess.run(["bash", str(ROOT / ".ci" / "run")], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 1 and "CI FAILED: make test-rngd (exit 5)" in out.stdout, out.stdout
