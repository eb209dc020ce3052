"""`rngd-pd generate`: one prompt through the colocated engine, streamed to stdout (or as JSON)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from rngd_pd.config.dtypes import COMPUTE_DTYPES, KV_DTYPES, torch_dtype
from rngd_pd.engine.colocated import ColocatedEngine
from rngd_pd.errors import ConfigError, RngdPdError
from rngd_pd.model import load_model
from rngd_pd.model.sampling import SamplingParams

HELP = "generate text for one prompt in this process (colocated engine, no Triton, no transfer)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", required=True, help="prompt text (special tokens like <|im_start|> are kept)")
    p.add_argument("--model", default=None,
                   help="GGUF file or Hugging Face checkpoint dir (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = no top-k")
    p.add_argument("--seed", type=int, default=None, help="same seed, same tokens")
    p.add_argument("--stop", action="extend", nargs="+", default=[], metavar="S",
                   help="stop strings (repeatable); the text ends before the first match")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16", help="KV cache dtype (default bf16)")
    p.add_argument("--dtype", choices=COMPUTE_DTYPES, default="fp32", help="compute dtype (default fp32)")
    p.add_argument("--chunk-size", type=int, default=512, help="prefill chunk size in tokens (default 512)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")


def run(args: argparse.Namespace) -> int:
    try:
        return _generate(args)
    except RngdPdError as e:
        print(f"rngd-pd generate: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _generate(args: argparse.Namespace) -> int:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop),
                            ignore_eos=args.ignore_eos)
    if not args.prompt:
        raise ConfigError("--prompt is empty; give some text")
    loaded = load_model(args.model, dtype=torch_dtype(args.dtype),
                        progress=sys.stderr.isatty() and not args.json)
    tok = loaded.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    prompt_ids = tok.encode(text)
    max_len = min(len(prompt_ids) + params.max_tokens, loaded.config.max_context)
    with ColocatedEngine(loaded, num_slots=1, max_len=max_len, kv_dtype=torch_dtype(args.kv_dtype),
                         chunk_size=args.chunk_size, buckets=[max_len]) as engine:
        t0 = time.perf_counter()
        ttft, ids, parts, reason = None, [], [], ""
        for ev in engine.stream(prompt_ids, params):
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            if ev.token_id is not None:
                ids.append(ev.token_id)
            parts.append(ev.text)
            reason = ev.finish_reason or reason
            if not args.json:
                sys.stdout.write(ev.text)
                sys.stdout.flush()
        total = time.perf_counter() - t0
    if args.json:
        decode_s = total - (ttft or 0.0)
        out = {
            "text": "".join(parts), "token_ids": ids, "prompt_token_ids": prompt_ids, "finish_reason": reason,
            "timing": {"ttft_ms": round((ttft or 0) * 1e3, 2), "total_ms": round(total * 1e3, 2),
                       "tpot_ms": round(decode_s * 1e3 / max(1, len(ids) - 1), 2)},
        }
        print(json.dumps(out, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
    return 0
