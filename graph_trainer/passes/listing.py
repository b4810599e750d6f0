"""`--compile.list_passes`: the registry's declarations as a plain-text table."""

from __future__ import annotations

from .registry import PASSES

COLUMNS = ("name", "stages", "modes", "requires", "conflicts", "last", "cuda", "needs", "description")


def _row(spec) -> tuple[str, ...]:
    def names(items: tuple[str, ...]) -> str:
        return ",".join(items) or "-"

    return (spec.name, names(spec.stages), names(spec.modes), names(spec.requires), names(spec.conflicts),
            "yes" if spec.must_be_last else "-", "yes" if spec.cuda_only else "-",
            names(tuple(f"{d}>1" for d in spec.needs_degrees)), spec.description)


def registry_table() -> str:
    rows = [COLUMNS, *(_row(spec) for _, spec in sorted(PASSES.items()))]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS) - 1)]
    lines = ["  ".join([*(cell.ljust(w) for cell, w in zip(row, widths)), row[-1]]).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in [*widths, len(COLUMNS[-1])]))
    return "\n".join(lines)
