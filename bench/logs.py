"""What the trainers print, read back: torchtitan's step lines, the first step's line of either trainer, NCCL's
choice of algorithm and protocol per collective (`NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=TUNING`), and a failed rank's own
error lines."""

from __future__ import annotations

import re
from collections import defaultdict

ANSI = re.compile(r"\x1b\[[0-9;]*m")
# torchrun's `--role rank --tee 3` puts `[rank<i>]:` before every line of a rank
_RANK_PREFIX = re.compile(r"^\[rank(\d+)\]:")
# a pipeline rank without the last stage logs the loss -1
_TITAN_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*(-?[\d.]+|nan|inf)\s+grad_norm:\s*([\d.]+|nan|inf).*?memory:\s*([\d.]+)GiB"
                         r".*?tps:\s*([\d,]+).*?mfu:\s*([\d.]+)%")
# both trainers' log line of step 1 (ours "step:    1  loss: ...", torchtitan's "step:  1  loss: ...")
FIRST_STEP = re.compile(r"step:\s*1\s+loss:")
_NCCL_TUNING = re.compile(r"NCCL INFO (\w+): (\d+) Bytes -> Algo (\w+) proto (\w+)")


def titan_records(output: str) -> list[dict]:
    """torchtitan's per-step log lines of rank 0 (every rank logs them)."""
    records = []
    for line in ANSI.sub("", output).splitlines():
        rank = _RANK_PREFIX.match(line)
        if rank and rank[1] != "0":
            continue
        m = _TITAN_LINE.search(line)
        if m:
            records.append({"step": int(m[1]), "loss": float(m[2]), "grad_norm": float(m[3]), "reserved_memory_gib": float(m[4]),
                            "tokens_per_second": float(m[5].replace(",", "")), "mfu": float(m[6])})
    return records


def nccl_protocols(output: str) -> dict[str, dict[str, dict[str, int]]]:
    """collective -> protocol -> {calls, bytes}, over every collective the run's communicators logged."""
    out: dict[str, dict[str, dict[str, int]]] = defaultdict(lambda: defaultdict(lambda: {"calls": 0, "bytes": 0}))
    for m in _NCCL_TUNING.finditer(output):
        entry = out[m[1]][m[4].upper()]
        entry["calls"] += 1
        entry["bytes"] += int(m[2])
    return {op: dict(protos) for op, protos in out.items()}


def main_protocols(protocols: dict[str, dict[str, dict[str, int]]]) -> str:
    """Per collective, the protocol that moved the most bytes and its share of them, e.g. "AllGather SIMPLE 97%"."""
    parts = []
    for op, protos in sorted(protocols.items()):
        total = sum(p["bytes"] for p in protos.values())
        name, top = max(protos.items(), key=lambda kv: kv[1]["bytes"])
        parts.append(f"{op} {name} {100 * top['bytes'] / total:.0f}%" if total else f"{op} {name}")
    return "; ".join(parts)


def error_lines(output: str) -> str:
    """The rank's own error lines, not torchrun's failure banner."""
    lines = [l for l in output.splitlines() if re.search(r"(Error|error:|Exception)", l) and "elastic" not in l]
    return "\n".join(lines[-6:]) or "\n".join(output.splitlines()[-15:])
