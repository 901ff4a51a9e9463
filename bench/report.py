"""Terminal table, JSON and PNG output of a run's levels."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from bench.client import RequestResult
from bench.runner import LevelResult, LoadShape

LATENCIES = (  # (summary key, column title, scale to the shown unit)
    ("admission_s", "admit ms", 1e3),
    ("ttft_s", "TTFT ms", 1e3),
    ("itl_s", "ITL ms", 1e3),
    ("e2e_s", "E2E s", 1.0),
    ("health_s", "/health ms", 1e3),
)


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1:
        return f"{value:.2f}"
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _triple(summary: dict[str, Any], scale: float) -> str:
    return "/".join(_num(None if summary[k] is None else summary[k] * scale) for k in ("p50", "p95", "p99"))


def table(levels: list[LevelResult], markdown: bool = False) -> str:
    header = ["server", "load", "sent", "ok", "429", "err", "in/out tok", "req/s", "out tok/s", "tot tok/s"]
    header += [f"{title} p50/95/99" for _, title, _ in LATENCIES]
    rows = [header]
    for level in levels:
        s = level.summary()
        row = [s["target"], level.shape.label(), str(s["sent"]), str(s["completed"]), str(s["rejected_429"])]
        per = max(1, s["completed"])
        row += [str(s["errors"]), f"{s['prompt_tokens'] / per:.0f}/{s['completion_tokens'] / per:.0f}"]
        row += [_num(s["requests_per_s"]), _num(s["output_tokens_per_s"])]
        row += [_num(s["total_tokens_per_s"])] + [_triple(s[key], scale) for key, _, scale in LATENCIES]
        rows.append(row)
    notes = [f"{level.target} {level.shape.label()}: {err}" for level in levels for err in level.summary()["error_samples"]]
    return "\n".join([format_rows(rows, markdown)] + (["", "errors seen:"] + notes if notes else []))


def format_rows(rows: list[list[str]], markdown: bool = False) -> str:
    if markdown:
        lines = ["| " + " | ".join(row) + " |" for row in rows]
        lines.insert(1, "|" + "|".join(" --- " for _ in rows[0]) + "|")
        return "\n".join(lines)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def server_table(levels: list[LevelResult], markdown: bool = False) -> str:
    """Server-side histograms (p50/p99 in ms) for servers with a Prometheus /metrics endpoint."""
    names = list(dict.fromkeys(name for level in levels for name in level.server_histograms))
    if not names:
        return ""
    short = [name.split("_", 1)[-1].removesuffix("_seconds") for name in names]
    rows = [["server", "load"] + [f"{s} p50/p99 ms" for s in short]]
    for level in levels:
        if level.server_histograms:
            cells = [level.server_histograms.get(name) for name in names]
            rows.append([level.target, level.shape.label()] + [
                "-" if c is None else "/".join(_num(None if c[k] is None else c[k] * 1e3) for k in ("p50", "p99"))
                for c in cells
            ])
    return "server-side, from /metrics (bucket-interpolated):\n" + format_rows(rows, markdown)


def to_json(levels: list[LevelResult], config: dict[str, Any]) -> dict[str, Any]:
    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": config,
        "levels": [
            {**level.summary(), "requests": [dataclasses.asdict(r) for r in level.requests], "health_samples_s": level.health}
            for level in levels
        ],
    }


def write_json(path: str | Path, levels: list[LevelResult], config: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(to_json(levels, config), indent=1))


def read_json(path: str | Path) -> tuple[list[LevelResult], dict[str, Any]]:
    """The levels of an earlier run's --json file, to print or plot again without measuring."""
    data = json.loads(Path(path).read_text())
    levels = [
        LevelResult(
            target=level["target"],
            shape=LoadShape(level["mode"], level["level"]),
            duration=level["duration_s"],
            requests=[RequestResult(**request) for request in level["requests"]],
            health=level["health_samples_s"],
            server_histograms=level.get("server_histograms", {}),
            loadavg=tuple(level.get("loadavg_before_after", (0.0, 0.0))),
        )
        for level in data["levels"]
    ]
    return levels, data.get("config", {})


def _series(level: LevelResult, key: str) -> list[float]:
    ok = [r for r in level.requests if r.outcome == "ok"]
    if key == "admission_s":
        return [r.admission * 1e3 for r in level.requests if r.admission is not None]
    if key == "ttft_s":
        return [r.ttft * 1e3 for r in ok if r.ttft is not None]
    if key == "itl_s":
        return [gap * 1e3 for r in ok for gap in r.itl]
    if key == "e2e_s":
        return [r.e2e for r in ok if r.e2e is not None]
    return [h * 1e3 for h in level.health]


def plot(path: str | Path, levels: list[LevelResult]) -> None:
    """Latency CDFs (one line per server and load) and output throughput against the load level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter, ScalarFormatter

    targets = list(dict.fromkeys(level.target for level in levels))
    colors = {t: plt.get_cmap("tab10")(i % 10) for i, t in enumerate(targets)}
    loads = sorted({level.shape.level for level in levels})
    fig, axes = plt.subplots(2, 3, figsize=(17, 9.5))
    for ax, (key, title, _) in zip(axes.flat, LATENCIES):
        for level in levels:
            data = sorted(_series(level, key))
            if not data:
                continue
            fraction = [(i + 1) / len(data) for i in range(len(data))]
            shade = 0.35 + 0.65 * (loads.index(level.shape.level) + 1) / len(loads)
            ax.step(data, fraction, where="post", color=colors[level.target], alpha=shade,
                    label=f"{level.target} {level.shape.label()}")
        ax.set_xscale("log")
        # 1-2-5 labels: decade-only labels leave a narrow range unlabelled, all minor labels overlap
        ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(f"{title} (CDF)")
        ax.set_ylabel("fraction of samples")
        ax.grid(True, which="both", alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    ax = axes.flat[5]
    for target in targets:
        points = sorted((lv.shape.level, lv.summary()["output_tokens_per_s"] or 0.0) for lv in levels if lv.target == target)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=colors[target], label=target)
    mode = levels[0].shape.mode if levels else "closed"
    ax.set_xlabel({"closed": "concurrent streams", "rate": "arrival rate (req/s)"}.get(mode, "burst size"))
    if len(loads) > 1:
        ax.set_xscale("log", base=2)
        ax.set_xticks(loads)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(bottom=0)
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
