"""The sweep's report: normalised rows, the side-by-side table with ratios, the targets, and the plot.

Pure functions over result rows (dicts), so tests drive them with synthetic rows and no servers.
A row is one (system, workload, concurrency) point:

    {"system": "pd", "workload": "fixed", "concurrency": 16, "output_tok_s": 310.0,
     "ttft_p50_ms": ..., "ttft_p99_ms": ..., "tpot_p50_ms": ..., "tpot_p99_ms": ..., "slo_share": 0.97, ...}
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

# Display order and names; systems not listed here come after, under their own name.
SYSTEMS: dict[str, str] = {
    "pd": "PD",
    "colocated": "colocated",
    "hf": "HF generate",
    "hf-cb": "HF cont. batching",
    "llamacpp": "llama.cpp",
    "vllm": "vLLM CPU",
}
METRICS = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "slo_share")

# load_gen field names -> the row's names (the first one present wins).
ALIASES: dict[str, tuple[str, ...]] = {
    "output_tok_s": ("output_tok_s", "output_tokens_per_s", "tok_s", "tokens_per_s"),
    "ttft_p50_ms": ("ttft_p50_ms", "ttft_ms_p50"),
    "ttft_p99_ms": ("ttft_p99_ms", "ttft_ms_p99"),
    "tpot_p50_ms": ("tpot_p50_ms", "tpot_ms_p50"),
    "tpot_p99_ms": ("tpot_p99_ms", "tpot_ms_p99"),
    "slo_share": ("slo_share", "slo_ok_share", "share_within_slo"),
    "requests": ("requests", "completed", "ok"),
    "mean_output_tokens": ("mean_output_tokens",),
    "errors": ("errors", "failed"),
}


def served(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The load generator's grid rows (the main tables): not aiperf's, nor the load_gen run paired with it."""
    return [r for r in rows if r.get("client", "load_gen") == "load_gen"]


def fixed_workloads(rows: Iterable[dict[str, Any]]) -> list[str]:
    """Fixed-shape workloads present: `fixed`, `fixed-256x64`, ... (by prompt length)."""
    names = {r["workload"] for r in rows if str(r.get("workload", "")).startswith("fixed")}
    return sorted(
        names,
        key=lambda n: [int(x) if x.isdigit() else 0 for x in n.replace("fixed", "").strip("-").split("x")],
    )


def normalise(raw: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """A load_gen summary mapped to the row's field names, plus `extra` (system, workload, ...)."""
    row: dict[str, Any] = {}
    for name, keys in ALIASES.items():
        row[name] = next((raw[k] for k in keys if raw.get(k) is not None), None)
    row.update(extra)
    return row


def system_order(rows: Iterable[dict[str, Any]]) -> list[str]:
    """Systems present in rows, in SYSTEMS order, unknown ones after."""
    present = {r["system"] for r in rows}
    return [s for s in SYSTEMS if s in present] + sorted(present - set(SYSTEMS))


def label(system: str) -> str:
    return SYSTEMS.get(system, system)


def _get(
    rows: Sequence[dict[str, Any]], system: str, workload: str, conc: int | None
) -> dict[str, Any] | None:
    for r in rows:
        if (
            r["system"] == system
            and r["workload"] == workload
            and (conc is None or r.get("concurrency") == conc)
        ):
            return r
    return None


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def _grid(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    grid = [list(header), *[list(b) for b in body]]
    widths = [max(len(g[i]) for g in grid) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(g, widths, strict=True)) for g in grid]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def metrics_table(rows: Sequence[dict[str, Any]]) -> str:
    """Every point: system, workload, concurrency and the metrics."""
    systems = system_order(rows)
    ordered = sorted(
        rows, key=lambda r: (systems.index(r["system"]), r["workload"], r.get("concurrency") or 0)
    )
    body = [
        [
            label(r["system"]),
            r["workload"],
            _fmt(r.get("concurrency")),
            _fmt(r.get("requests")),
            _fmt(r.get("mean_output_tokens")),
            *(_fmt(r.get(m)) for m in METRICS),
            _fmt(r.get("mfu")),
            _fmt(r.get("power_w")),
            _fmt(r.get("note", "")),
        ]
        for r in ordered
    ]
    header = ["system", "workload", "conc", "reqs", "out_tok", *METRICS, "mfu", "power_w", "note"]
    return _grid(header, body)


def ratio_table(rows: Sequence[dict[str, Any]], metric: str = "output_tok_s", base: str = "pd") -> str:
    """One line per (workload, concurrency): `metric` of each system side by side, then base / each."""
    systems = system_order(rows)
    others = [s for s in systems if s != base]
    points = sorted({(r["workload"], r.get("concurrency")) for r in rows}, key=lambda p: (p[0], p[1] or 0))
    body = []
    for wl, c in points:
        vals = {s: (_get(rows, s, wl, c) or {}).get(metric) for s in systems}
        ratios = [_fmt(vals[base] / vals[s], 2) if vals.get(base) and vals.get(s) else "-" for s in others]
        body.append([wl, _fmt(c), *(_fmt(vals[s]) for s in systems), *ratios])
    header = [
        "workload",
        "conc",
        *(label(s) for s in systems),
        *(f"{label(base)}/{label(s)}" for s in others),
    ]
    return f"{metric} side by side\n" + _grid(header, body)


def targets(
    rows: Sequence[dict[str, Any]], workload: str = "fixed", mixed: str = "mixed"
) -> list[dict[str, Any]]:
    """The issue's three targets: each with the measured values and whether it is met (None: not run)."""

    def tok(system: str, c: int) -> float | None:
        return (_get(rows, system, workload, c) or {}).get("output_tok_s")

    out = []
    one, sixteen = tok("pd", 1), tok("pd", 16)
    scale = sixteen / one if one and sixteen else None
    out.append(
        {
            "target": "PD tok/s at 16 streams >= 8x single-stream",
            "value": scale,
            "goal": 8.0,
            "met": None if scale is None else scale >= 8.0,
        }
    )
    pd_p99 = (_get(rows, "pd", mixed, None) or {}).get("tpot_p99_ms")
    co_p99 = (_get(rows, "colocated", mixed, None) or {}).get("tpot_p99_ms")
    ok = None if pd_p99 is None or co_p99 is None else pd_p99 <= co_p99
    out.append(
        {"target": "PD TPOT p99 (mixed trace) <= colocated's", "value": pd_p99, "goal": co_p99, "met": ok}
    )
    for peer in ("hf", "hf-cb", "llamacpp", "vllm"):
        theirs = tok(peer, 16)
        if theirs is None and not any(r["system"] == peer for r in rows):
            continue
        met = None if sixteen is None or theirs is None else sixteen > theirs
        out.append(
            {
                "target": f"PD tok/s at 16 streams > {label(peer)}",
                "value": sixteen,
                "goal": theirs,
                "met": met,
            }
        )
    return out


def targets_text(ts: Sequence[dict[str, Any]]) -> str:
    word = {True: "MET", False: "NOT MET", None: "not measured"}
    return "\n".join(
        f"[{word[t['met']]:>12}] {t['target']}: {_fmt(t['value'])} vs {_fmt(t['goal'])}" for t in ts
    )


def plot(
    rows: Sequence[dict[str, Any]], path: Path, workload: str | None = None, mixed: str = "mixed"
) -> Path:
    """PNG: aggregate output tok/s against TPOT p99, one line per system over concurrency (mixed: X).

    One panel per fixed-shape workload (`fixed-256x64`, `fixed-512x128`, ...), or only `workload`.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    second = [
        r for r in rows if r.get("client") == "aiperf" and r.get("tpot_p99_ms") and r.get("output_tok_s")
    ]
    rows = served(rows)
    names = [workload] if workload else (fixed_workloads(rows) or ["fixed"])
    fig, axes = plt.subplots(1, len(names), figsize=(7.5 * len(names), 5), squeeze=False)
    systems = system_order(rows)
    for ax, name in zip(axes[0], names, strict=True):
        _panel(ax, rows, systems, name, mixed if name == names[0] else None)
        for r in second:  # the same point through aiperf: a hollow square in the system's colour
            if r["workload"] == name and r["system"] in systems:
                color = f"C{systems.index(r['system'])}"
                ax.plot(
                    [r["tpot_p99_ms"]],
                    [r["output_tok_s"]],
                    "s",
                    mfc="none",
                    color=color,
                    markersize=9,
                    label=f"{label(r['system'])} (aiperf, {r.get('concurrency')} streams)",
                )
        if second:
            ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _panel(
    ax: Any, rows: Sequence[dict[str, Any]], systems: list[str], workload: str, mixed: str | None
) -> None:
    for i, s in enumerate(systems):
        color = f"C{i}"
        pts = sorted(
            (
                r
                for r in rows
                if r["system"] == s
                and r["workload"] == workload
                and r.get("tpot_p99_ms")
                and r.get("output_tok_s")
            ),
            key=lambda r: r["concurrency"],
        )
        if pts:
            ax.plot(
                [r["tpot_p99_ms"] for r in pts],
                [r["output_tok_s"] for r in pts],
                "o-",
                color=color,
                label=label(s),
            )
            for r in pts:
                ax.annotate(
                    str(r["concurrency"]),
                    (r["tpot_p99_ms"], r["output_tok_s"]),
                    fontsize=7,
                    textcoords="offset points",
                    xytext=(3, 3),
                )
        m = _get(rows, s, mixed, None) if mixed else None
        if m and m.get("tpot_p99_ms") and m.get("output_tok_s"):
            ax.plot(
                [m["tpot_p99_ms"]],
                [m["output_tok_s"]],
                "x",
                color=color,
                markersize=9,
                label=f"{label(s)} ({mixed} trace)",
            )
    ax.set_xscale("log")
    ax.set_xlabel("TPOT p99 (ms, log)")
    ax.set_ylabel("aggregate output tokens/s")
    shape = workload.replace("fixed-", "").replace("x", " / ") + " tokens, " if workload != "fixed" else ""
    ax.set_title(f"{shape}throughput against TPOT p99 (labels: concurrent streams)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


# Issue 13's judged ratios: (metric, concurrency, goal on pd / peer, True when higher is better).
ISSUE13_CHECKS: tuple[tuple[str, int, float, bool], ...] = (
    ("output_tok_s", 8, 1.5, True),
    ("output_tok_s", 16, 1.5, True),
    ("ttft_p50_ms", 1, 1.0, False),
    ("tpot_p99_ms", 16, 1.0, False),
)


def issue13(rows: Sequence[dict[str, Any]], peer: str = "vllm", base: str = "pd") -> list[dict[str, Any]]:
    """Issue 13's ratios per fixed workload: base / peer for tok/s at 8 and 16, TTFT p50 at 1, TPOT p99 at 16.

    Goals: tok/s ratio >= 1.5; TTFT and TPOT ratios <= 1 (base no slower). `met` is None when a side
    was not measured. colocated's value is carried along for context.
    """
    rows = served(rows)
    out = []
    for wl in fixed_workloads(rows):
        for metric, c, goal, higher in ISSUE13_CHECKS:
            ours = (_get(rows, base, wl, c) or {}).get(metric)
            theirs = (_get(rows, peer, wl, c) or {}).get(metric)
            colo = (_get(rows, "colocated", wl, c) or {}).get(metric)
            ratio = round(ours / theirs, 3) if ours and theirs else None
            met = None if ratio is None else (ratio >= goal if higher else ratio <= goal)
            out.append(
                {
                    "workload": wl,
                    "metric": metric,
                    "concurrency": c,
                    base: ours,
                    peer: theirs,
                    "colocated": colo,
                    "ratio": ratio,
                    "goal": f"{'>=' if higher else '<='} {goal:g}",
                    "met": met,
                }
            )
    return out


def issue13_text(checks: Sequence[dict[str, Any]], peer: str = "vllm", base: str = "pd") -> str:
    word = {True: "MET", False: "NOT MET", None: "not measured"}
    body = [
        [
            c["workload"],
            c["metric"],
            str(c["concurrency"]),
            _fmt(c.get(base)),
            _fmt(c.get(peer)),
            _fmt(c.get("colocated")),
            _fmt(c["ratio"], 3),
            c["goal"],
            word[c["met"]],
        ]
        for c in checks
    ]
    header = [
        "workload",
        "metric",
        "conc",
        label(base),
        label(peer),
        "colocated",
        f"{label(base)}/{label(peer)}",
        "goal",
        "",
    ]
    return f"issue 13: {label(base)} against {label(peer)}\n" + _grid(header, body)


AIPERF_FIELDS = (
    "output_tok_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "mean_output_tokens",
)


def aiperf_compare(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each aiperf row next to the load generator's row of the same point, and aiperf / load_gen.

    The load_gen row is the one run right before aiperf (client `load_gen-paired`) where there is one,
    so both clients saw the same machine load; else the grid's row of that point.
    """
    ours = served(rows)
    paired = [r for r in rows if r.get("client") == "load_gen-paired"]
    out = []
    for r in rows:
        if r.get("client") != "aiperf":
            continue
        point = (r["system"], r["workload"], r.get("concurrency"))
        lg = _get(paired, *point) or _get(ours, *point) or {}
        entry: dict[str, Any] = {
            "system": r["system"],
            "workload": r["workload"],
            "concurrency": r.get("concurrency"),
            "note": r.get("note", ""),
            "load_gen_row": lg.get("client"),
            "loadavg_1m": {"aiperf": r.get("loadavg_1m"), "load_gen": lg.get("loadavg_1m")},
        }
        for f in AIPERF_FIELDS:
            a, b = r.get(f), lg.get(f)
            entry[f] = {"aiperf": a, "load_gen": b, "ratio": round(a / b, 3) if a and b else None}
        out.append(entry)
    return out


def aiperf_text(entries: Sequence[dict[str, Any]]) -> str:
    body = []
    for e in entries:
        for client in ("load_gen", "aiperf"):
            body.append(
                [
                    label(e["system"]),
                    e["workload"],
                    _fmt(e["concurrency"]),
                    client,
                    *(_fmt(e[f][client]) for f in AIPERF_FIELDS),
                    _fmt(e.get("loadavg_1m", {}).get(client)),
                    e["note"] if client == "aiperf" else "",
                ]
            )
        body.append(["", "", "", "aiperf/load_gen", *(_fmt(e[f]["ratio"], 3) for f in AIPERF_FIELDS), "", ""])
    header = ["system", "workload", "conc", "client", *AIPERF_FIELDS, "load_1m", "note"]
    return "the same point through two clients (aiperf's TPOT = its inter-token latency)\n" + _grid(
        header, body
    )


def summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What report.json holds: issue 13's ratios, aiperf next to load_gen, the targets, the rows (no raw)."""
    return {
        "issue13": issue13(rows),
        "aiperf": aiperf_compare(rows),
        "targets": targets(served(rows)),
        "rows": [{k: v for k, v in r.items() if k != "raw"} for r in rows],
    }


def report(rows: Sequence[dict[str, Any]]) -> str:
    """The full text report: metrics, ratios of tok/s and TPOT p99, the targets, issue 13, aiperf."""
    ours = served(rows)
    parts = [
        metrics_table(ours),
        "",
        ratio_table(ours, "output_tok_s"),
        "",
        ratio_table(ours, "ttft_p50_ms"),
        "",
        ratio_table(ours, "tpot_p99_ms"),
        "",
        "targets",
        targets_text(targets(ours)),
    ]
    if any(r["system"] == "vllm" for r in ours):
        parts += ["", issue13_text(issue13(ours))]
    entries = aiperf_compare(rows)
    if entries:
        parts += ["", aiperf_text(entries)]
    return "\n".join(parts)
