"""KPIs ai-rm reads: MFU, power (watts) and tokens per joule, summed over the cards a configuration uses.

MFU = model FLOPs of the tokens served per second / the cards' peak FLOPs. Peaks: NPUs from the
vendors' public spec sheets (16-bit float); the CPU's is measured (a torch matmul) or given with
--peak-tflops. Power comes from the device's own tool (furiosa-smi, rbln-stat) or, on CPUs, from RAPL
energy counters under /sys/class/powercap; where none is readable the row says so instead of guessing.

    python bench/kpi.py --peaks                                   # the peak table (measures the CPU)
    python bench/kpi.py --cards cpu:0 --in results.jsonl          # KPIs of load_gen JSON lines
    python bench/kpi.py --cards cpu:0 -- .venv/bin/python bench/load_gen.py ...   # measure power too
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(ROOT))

from bench.power import PowerReading, open_meter  # noqa: E402
from rngd_pd.errors import ConfigError  # noqa: E402


class ShapeLike(Protocol):
    """The ModelConfig fields the FLOP count needs (rngd_pd.model.ModelConfig has them)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class DevicePeak:
    """Peak dense FLOPs of one card, the dtype it is quoted for, and where the number comes from."""

    device: str
    tflops: float
    dtype: str
    source: str


SPEC_PEAKS: dict[str, DevicePeak] = {
    "rngd": DevicePeak("rngd", 256.0, "bf16", "FuriosaAI RNGD spec sheet: 256 TFLOPS BF16 (512 FP8)"),
    "atom": DevicePeak(
        "atom",
        32.0,
        "fp16",
        "Rebellions ATOM spec sheet: 32 TFLOPS FP16 (128 TOPS INT8); it quotes no BF16 figure",
    ),
}


@dataclass(frozen=True)
class Card:
    """One physical device a configuration uses (`rngd:0`, `atom:1`, `cpu:0` = a CPU socket)."""

    device: str
    index: int = 0

    def __str__(self) -> str:
        return f"{self.device}:{self.index}"


def parse_cards(text: str) -> list[Card]:
    """`rngd:0,atom:0` -> cards; duplicates are dropped (PD on one CPU uses that CPU once)."""
    cards: list[Card] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, idx = part.partition(":")
        if name not in (*SPEC_PEAKS, "cpu"):
            raise ConfigError(f"unknown device {name!r} in --cards {text!r}; use cpu, rngd or atom")
        try:
            card = Card(name, int(idx or 0))
        except ValueError as e:
            raise ConfigError(f"card index {idx!r} in {part!r} is not an integer") from e
        if card not in cards:
            cards.append(card)
    if not cards:
        raise ConfigError("no cards given; e.g. --cards cpu:0 or --cards rngd:0,atom:0")
    return cards


# ----------------------------------------------------------------------------- FLOPs


def matmul_params(cfg: ShapeLike) -> int:
    """Weights that take part in a matmul per token (the embedding lookup is free, the LM head is not)."""
    q = cfg.hidden_size * cfg.num_heads * cfg.head_dim
    kv = 2 * cfg.hidden_size * cfg.num_kv_heads * cfg.head_dim
    o = cfg.num_heads * cfg.head_dim * cfg.hidden_size
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    return cfg.num_layers * (q + kv + o + mlp) + cfg.hidden_size * cfg.vocab_size


def flops_per_token(cfg: ShapeLike, context: float) -> float:
    """FLOPs of one token attending over `context` earlier tokens: 2 per weight + QK^T and AV."""
    attn = 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context
    return 2.0 * matmul_params(cfg) + attn


def request_flops(cfg: ShapeLike, prompt: float, output: float) -> float:
    """FLOPs of a whole request: the prompt's tokens (prefill) and each generated token (decode)."""
    # Token i attends over i earlier tokens, so the mean context of a span is its middle.
    prefill = prompt * flops_per_token(cfg, prompt / 2.0)
    decode = output * flops_per_token(cfg, prompt + output / 2.0)
    return prefill + decode


# ----------------------------------------------------------------------------- peaks


def measure_cpu_tflops(seconds: float = 1.0, n: int = 1024, dtype: str = "float32") -> float:
    """Sustained dense matmul TFLOP/s of this CPU with torch's current thread count."""
    import torch

    td = getattr(torch, dtype)
    a, b = torch.randn(n, n, dtype=td), torch.randn(n, n, dtype=td)
    torch.mm(a, b)  # warm up
    count, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds or count < 3:
        torch.mm(a, b)
        count += 1
    return 2.0 * n**3 * count / elapsed / 1e12


def card_peak(
    card: Card, peak_tflops: float | None = None, cpu_dtypes: Sequence[str] = ("float32", "bfloat16")
) -> DevicePeak:
    """The peak of one card: the override, the spec sheet (NPUs) or a measurement (CPU, best dtype)."""
    if peak_tflops is not None:
        return DevicePeak(card.device, peak_tflops, "given", "--peak-tflops")
    if card.device in SPEC_PEAKS:
        return SPEC_PEAKS[card.device]
    tf, dt = max((measure_cpu_tflops(dtype=d), d) for d in cpu_dtypes)
    return DevicePeak(
        "cpu", tf, dt, f"measured: best torch matmul 1024^3 of {'/'.join(cpu_dtypes)}, 1 s each"
    )


def total_peak(cards: Sequence[Card], peak_tflops: float | None = None) -> tuple[float, list[DevicePeak]]:
    """Summed peak TFLOP/s over cards (the CPU measured once even if listed for both roles)."""
    cache: dict[str, DevicePeak] = {}
    peaks = []
    for c in cards:
        if c.device not in cache:
            cache[c.device] = card_peak(c, peak_tflops)
        peaks.append(cache[c.device])
    return sum(p.tflops for p in peaks), peaks


# ----------------------------------------------------------------------------- KPI rows

# load_gen's JSON field names, with the aliases other tools use for the same thing.
_ALIASES: dict[str, tuple[str, ...]] = {
    "output_tok_s": ("output_tok_s", "output_tokens_per_s", "tok_s", "tokens_per_s", "throughput_tok_s"),
    "duration_s": ("duration_s", "wall_s", "elapsed_s"),
    "requests": ("requests", "completed", "num_requests", "ok"),
    "mean_prompt_tokens": ("mean_prompt_tokens", "mean_input_tokens", "prompt_tokens_mean"),
    "mean_output_tokens": ("mean_output_tokens", "output_tokens_mean"),
}


def field(row: dict[str, Any], name: str) -> float | None:
    """A numeric field of a load_gen row by its canonical name or an alias; None when absent."""
    for key in _ALIASES.get(name, (name,)):
        v = row.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool):
            return float(v)
    return None


def kpis(
    row: dict[str, Any],
    cfg: ShapeLike,
    peak_tflops_total: float,
    power: PowerReading | None = None,
) -> dict[str, Any]:
    """MFU, achieved TFLOP/s, watts and tokens/J for one load_gen summary row."""
    tok_s = field(row, "output_tok_s") or 0.0
    out_mean = field(row, "mean_output_tokens")
    prompt_mean = field(row, "mean_prompt_tokens") or 0.0
    if out_mean:  # whole requests: prefill FLOPs count too
        achieved = tok_s / out_mean * request_flops(cfg, prompt_mean, out_mean)
    else:
        achieved = tok_s * flops_per_token(cfg, prompt_mean)
    out: dict[str, Any] = {
        "model_tflops": achieved / 1e12,
        "peak_tflops": peak_tflops_total,
        "mfu": achieved / (peak_tflops_total * 1e12) if peak_tflops_total > 0 else None,
        "flops_per_token": flops_per_token(cfg, prompt_mean),
    }
    out.update(power_fields(power, tok_s))
    return out


def power_fields(power: PowerReading | None, tok_s: float) -> dict[str, Any]:
    """power_w / tok_per_j when a reading exists, else the reason it does not."""
    if power is None or power.watts is None:
        return {
            "power_w": None,
            "tok_per_j": None,
            "power_source": power.note if power else "not measured (no command was run under the meter)",
        }
    return {
        "power_w": power.watts,
        "tok_per_j": tok_s / power.watts if power.watts > 0 else None,
        "power_source": power.note,
    }


def read_rows(lines: Iterable[str]) -> list[dict[str, Any]]:
    """JSON objects from JSON lines; other lines (tables, logs) are skipped."""
    rows = []
    for line in lines:
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                rows.append(obj)
    return rows


def load_model_config(path: str | None) -> ShapeLike:
    """The served model's config (the embedded SmolLM2 when path is None)."""
    from rngd_pd.model import load_model

    return load_model(path, progress=False).config


def format_table(rows: Sequence[dict[str, Any]], cols: Sequence[str]) -> str:
    """A plain text table; floats with 3 significant digits, missing values as '-'."""

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}"
        return str(v)

    grid = [list(cols)] + [[cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(g[i]) for g in grid) for i in range(len(cols))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(g, widths, strict=True)) for g in grid)


def _peaks_table(cards: Sequence[Card], peak: float | None) -> str:
    _, peaks = total_peak(cards, peak)
    rows = [
        {"card": str(c), "tflops": p.tflops, "dtype": p.dtype, "source": p.source}
        for c, p in zip(cards, peaks, strict=True)
    ]
    return format_table(rows, ["card", "tflops", "dtype", "source"])


def main(argv: list[str] | None = None) -> int:
    """CLI over load_gen JSON lines (a file, stdin, or a command run under the power meter)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cards", default="cpu:0", help="cards the configuration uses, e.g. rngd:0,atom:0")
    ap.add_argument("--peak-tflops", type=float, help="peak per card instead of the table / measurement")
    ap.add_argument("--model", help="model path (default: the embedded SmolLM2-135M)")
    ap.add_argument("--in", dest="inp", type=Path, help="load_gen JSON lines (default: stdin)")
    ap.add_argument("--peaks", action="store_true", help="print the peak table and exit")
    ap.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    a = ap.parse_args(argv)
    cards = parse_cards(a.cards)
    if a.peaks:
        print(_peaks_table(cards, a.peak_tflops))
        return 0
    power = None
    if cmd:
        meter = open_meter(cards)
        meter.start()
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
        power = meter.stop()
        if proc.returncode:
            print(f"command exited {proc.returncode}", file=sys.stderr)
            return proc.returncode
        lines = proc.stdout.splitlines()
    else:
        lines = (a.inp.read_text() if a.inp else sys.stdin.read()).splitlines()
    peak, _ = total_peak(cards, a.peak_tflops)
    cfg = load_model_config(a.model)
    rows = [{**r, **kpis(r, cfg, peak, power), "cards": a.cards} for r in read_rows(lines)]
    if a.json:
        for r in rows:
            print(json.dumps(r))
    else:
        print(
            format_table(
                rows,
                [
                    "cards",
                    "output_tok_s",
                    "model_tflops",
                    "peak_tflops",
                    "mfu",
                    "power_w",
                    "tok_per_j",
                    "power_source",
                ],
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
