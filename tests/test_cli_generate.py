"""`rngd-pd generate`: the real console script in a subprocess (JSON output, exit codes) and the
streaming text mode in-process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rngd_pd import cli
from rngd_pd.engine.colocated import ColocatedEngine
from rngd_pd.model.sampling import SamplingParams

SCRIPT = Path(sys.executable).with_name("rngd-pd")
PROMPT = "The three primary colors are"


def rngd_pd(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    return subprocess.run([str(SCRIPT), "generate", *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


@pytest.mark.slow
def test_json_output_matches_the_engine(smollm) -> None:
    proc = rngd_pd("--prompt", PROMPT, "--max-tokens", "6", "--kv-dtype", "fp32", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    ids = smollm.tokenizer.encode(PROMPT)
    assert out["prompt_token_ids"] == ids
    assert out["finish_reason"] in ("length", "eos") and 1 <= len(out["token_ids"]) <= 6
    import torch

    with ColocatedEngine(smollm, max_len=64, kv_dtype=torch.float32) as eng:
        ref = eng.generate(ids, SamplingParams(max_tokens=6))
    assert out["token_ids"] == ref.token_ids and out["text"] == ref.text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prompt", "", "--max-tokens", "4"], "empty"),
        (["--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
        (["--prompt", "hi", "--top-p", "0"], "top_p"),
        (["--prompt", "hi", "--model", "/nonexistent/model.gguf"], "no such file"),
    ],
)
def test_bad_input_exits_nonzero_with_a_message(args: list[str], message: str) -> None:
    proc = rngd_pd(*args)
    assert proc.returncode != 0
    assert message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_corrupt_model_file_and_too_long_prompt(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(256))
    proc = rngd_pd("--prompt", "hi", "--model", str(bad))
    assert proc.returncode != 0 and "broken.gguf" in proc.stderr and "Traceback" not in proc.stderr
    proc = rngd_pd("--prompt", "hi there", "--max-tokens", "8191")
    assert proc.returncode != 0 and "exceeds" in proc.stderr and "8192" in proc.stderr


def test_streaming_text_chat_and_stop(smollm, monkeypatch, capsys) -> None:
    import rngd_pd.model

    monkeypatch.setattr(rngd_pd.model, "load_model", lambda *a, **k: smollm)
    ask = "Write one sentence about the sea."
    base = ["generate", "--prompt", ask, "--chat", "--max-tokens", "8"]
    assert cli.main([*base, "--json"]) == 0
    ref = json.loads(capsys.readouterr().out)
    chat = smollm.tokenizer.apply_chat_template([{"role": "user", "content": ask}])
    assert ref["prompt_token_ids"] == smollm.tokenizer.encode(chat)
    assert cli.main(base) == 0
    assert capsys.readouterr().out == ref["text"] + "\n"
    stop = ref["text"][2:5]
    assert cli.main([*base, "--json", "--stop", stop]) == 0
    stopped = json.loads(capsys.readouterr().out)
    assert stopped["finish_reason"] == "stop" and stopped["text"] == ref["text"][: ref["text"].index(stop)]
