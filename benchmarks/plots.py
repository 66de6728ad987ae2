"""PNG plots from the parts' results: CPU and bytes vs output length per path, latency distributions."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _errorbar(ax, xs: list[int], stats: list[dict[str, float]], label: str, scale: float = 1.0) -> None:
    med = [s["median"] * scale for s in stats]
    lo = [m - s["min"] * scale for m, s in zip(med, stats)]
    hi = [s["max"] * scale - m for m, s in zip(med, stats)]
    ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, label=label)


def derender(result: dict[str, Any], out: Path) -> list[str]:
    plt = _plt()
    table = result["table"]
    fig, (cpu_ax, bytes_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for path, by_n in table.items():
        ns = sorted(by_n, key=int)
        _errorbar(cpu_ax, [int(n) for n in ns], [by_n[n]["cpu_total_s"] for n in ns], path)
        if path.startswith(("chained", "session")):
            _errorbar(bytes_ax, [int(n) for n in ns], [by_n[n]["bytes_to_derender"] for n in ns], path, 1 / 2**20)
    cpu_ax.set(xscale="log", yscale="log", xlabel="output tokens", ylabel="non-engine CPU (s)",
               title="CPU per request (coupled: API; others: API + sidecar + render)")
    bytes_ax.set(xscale="log", yscale="log", xlabel="output tokens", ylabel="MiB sidecar → derender",
                 title="bytes to the derender tier")
    for ax in (cpu_ax, bytes_ax):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "derender.png", dpi=110)
    plt.close(fig)
    return ["derender.png"]


def proxy(result: dict[str, Any], out: Path) -> list[str]:
    plt = _plt()
    table = result["table"]
    kinds = list(table)
    rows = (len(kinds) + 1) // 2  # an API's batch and stream side by side, one API per row
    fig, axes = plt.subplots(rows, 2, figsize=(8, 4.5 * rows), sharey=False, squeeze=False)
    for ax, kind in zip(axes.flat, kinds):
        data, labels = [], []
        for c in sorted(table[kind], key=int):
            for side in ("direct", "sidecar"):
                data.append(table[kind][c][side]["latency_ms"])
                labels.append(f"c{c}\n{side}")
        ax.boxplot(data, tick_labels=labels, showfliers=False, whis=(1, 99))
        ax.set(title=kind, ylabel="latency (ms), whiskers p1-p99", yscale="log")
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(True, axis="y", alpha=0.3)
    for ax in axes.flat[len(kinds):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out / "proxy_latency.png", dpi=110)
    plt.close(fig)
    return ["proxy_latency.png"]


PLOTS = {"derender": derender, "proxy": proxy}


def write(parts: dict[str, dict[str, Any]], out: Path) -> list[str]:
    files: list[str] = []
    for name, fn in PLOTS.items():
        if name in parts:
            files += fn(parts[name], out)
    return files
