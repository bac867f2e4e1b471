"""What a bench run prints and writes: the comparison table, the results JSON and the PNG figure.

The results file is {"schema", "created", "meta", "runs": [run objects, exactly metrics.RUN_KEYS],
"details": {run name: counts, errors, notes and raw latency samples}}: the run objects stay fixed for
tools that read them, everything else goes beside them.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

SCHEMA = "tpserve.bench/1"


def _fmt(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def format_table(
    runs: list[dict], details: dict[str, dict] | None = None, reference: dict[str, str] | None = None
) -> str:
    """One row per run. reference maps a run's name to the run its output throughput is divided by (the
    'x ref' column); None: no ratio column."""
    details = details or {}
    by_name = {r["name"]: r for r in runs}
    head = ["run", "ok/n", "out tok/s", "req/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "ITL p99"]
    head += ["E2E p50", "E2E p99", "goodput", "batch", "overhead%", "peak RSS MB"]
    if reference:
        head.append("x ref")
    rows = []
    for r in runs:
        d = details.get(r["name"], {})
        if d.get("error"):
            rows.append([r["name"], f"not run: {d['error']}"])
            continue
        tps = r["output_tokens_per_s"]
        row = [
            r["name"],
            f"{d.get('completed', '?')}/{d.get('num_requests', '?')}",
            _fmt(tps, 1),
            _fmt(r["requests_per_s"], 2),
            _fmt(r["ttft_ms"]["p50"]),
            _fmt(r["ttft_ms"]["p99"]),
            _fmt(r["tpot_ms"]["p50"], 1),
            _fmt(r["tpot_ms"]["p99"], 1),
            _fmt(r["itl_ms"]["p99"], 1),
            _fmt(r["e2e_ms"]["p50"]),
            _fmt(r["e2e_ms"]["p99"]),
            _fmt(r["goodput_rps"], 2),
            _fmt(r["mean_batch_size"], 1),
            _fmt(d.get("engine_overhead_pct"), 1),
            _fmt(sum(v for v in r["peak_rss_mb"].values() if v is not None) or None),
        ]
        if reference:
            ref = by_name.get(reference.get(r["name"], ""))
            ref_tps = ref["output_tokens_per_s"] if ref else None
            row.append("-" if not ref_tps or tps is None else f"{tps / ref_tps:.2f}x")
        rows.append(row)
    widths = [
        max(len(str(x[i])) for x in [head, *[r for r in rows if len(r) == len(head)]])
        for i in range(len(head))
    ]
    lines = [
        "  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(head, widths, strict=True)))
    ]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        if len(row) != len(head):
            lines.append(f"{row[0].ljust(widths[0])}  {row[1]}")
            continue
        lines.append(
            "  ".join(
                str(c).rjust(w) if i else str(c).ljust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    lines.append(
        "latencies in ms; goodput in req/s meeting every SLO given; batch = mean sequences per step; "
        "overhead% = share of the server's step time outside the forward pass"
    )
    return "\n".join(lines)


def format_speculation(name: str, figures: dict | None) -> str:
    """One line on what speculative decoding did in a run (empty when it proposed nothing)."""
    if not figures:
        return ""
    per_position = " ".join(f"{a:.2f}" for a in figures["acceptance_per_position"])
    return (
        f"{name}: speculative decoding: {figures['num_drafts']:,} verifications of "
        f"{figures['num_draft_tokens']:,} proposed tokens, acceptance rate {figures['acceptance_rate']:.1%}, "
        f"mean accepted length {figures['mean_accepted_length']:.2f} tokens, acceptance by position "
        f"{per_position}"
    )


def write_json(path: str | Path, runs: list[dict], details: dict[str, dict], meta: dict) -> None:
    doc = {
        "schema": SCHEMA,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "meta": meta,
        "runs": runs,
        "details": details,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def plot(path: str | Path, runs: list[dict], details: dict[str, dict]) -> None:
    """Output throughput bars, and CDFs of TTFT, TPOT and end-to-end latency per run."""
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on servers and CI
    import matplotlib.pyplot as plt
    import numpy as np

    shown = [r for r in runs if not details.get(r["name"], {}).get("error")]
    fig, axes = plt.subplots(1, 4, figsize=(22, 5.5))
    names = [r["name"] for r in shown]
    axes[0].barh(names, [r["output_tokens_per_s"] for r in shown], color="tab:blue")
    axes[0].invert_yaxis()
    axes[0].set_xlabel("output tokens/s")
    axes[0].set_title("throughput")
    # One colour per system, one line style per arrival phase ("system/phase" names; others solid).
    systems = list(dict.fromkeys(n.split("/")[0] for n in names))
    phases = list(dict.fromkeys(n.split("/")[1] if "/" in n else "" for n in names))
    for ax, key, label in zip(axes[1:], ("ttft", "tpot", "e2e"), ("TTFT", "TPOT", "end-to-end"), strict=True):
        for r in shown:
            samples = np.sort(details.get(r["name"], {}).get("samples_ms", {}).get(key, []))
            system, _, phase = r["name"].partition("/")
            style = {
                "color": f"C{systems.index(system) % 10}",
                "linestyle": ("-", "--", ":")[phases.index(phase) % 3],
            }
            if len(samples):
                ax.plot(samples, np.arange(1, len(samples) + 1) / len(samples), label=r["name"], **style)
        ax.set_xscale("log")
        ax.set_xlabel(f"{label} (ms, log)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{label} CDF")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
