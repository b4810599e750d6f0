"""The plots of `graph-trainer compare`: loss curves overlaid, tokens/s per step, peak memory per run."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_runs(results: list[dict[str, Any]], warmup: int, out: Path) -> list[Path]:
    """Write loss.png, tokens_per_second.png and peak_memory.png into `out`; returns their paths.
    A failed run is drawn with the steps it logged, dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, ylabel in (("loss", "loss"), ("tokens_per_second", "tokens/s (rank 0)")):
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for r in results:
            if r["metrics"]:
                steps = [m["step"] for m in r["metrics"]]
                ax.plot(steps, [m[key] for m in r["metrics"]], marker=".", label=r["name"],
                        linestyle="-" if r["status"] == "ok" else "--")
        if key == "tokens_per_second" and warmup:
            ax.axvspan(0.5, warmup + 0.5, color="0.9", label="warm-up (not in the median)")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        paths.append(out / f"{key}.png")
        fig.savefig(paths[-1], dpi=90)
        plt.close(fig)

    measured = [r for r in results if r["peak_memory_gib"] is not None]
    fig, ax = plt.subplots(figsize=(8, max(2.5, 0.5 * len(results) + 1)))
    ax.barh([r["name"] for r in measured], [r["peak_memory_gib"] for r in measured])
    ax.invert_yaxis()
    ax.set_xlabel("peak memory GiB (rank 0)")
    fig.tight_layout()
    paths.append(out / "peak_memory.png")
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)
    return paths
