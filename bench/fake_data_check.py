"""GPU check of what fake-communication throughput figures rest on: (1) what torch's fake process
group leaves in a collective's output on this torch, and what it leaves with graph-trainer's
kernels (graph_trainer.parallel.fake_data) (copies of the input, as a real collective's
shapes and magnitudes would give, or the output untouched), and (2) whether a bf16 GEMM's speed
depends on the values it multiplies (random, NaN, zeros): a power-limited GPU runs cooler data at
higher clocks, so a run whose tensors went NaN is not comparable with one whose did not.

    python bench/fake_data_check.py --out $OUT    # writes fake_data_check.json, prints a summary

Exit code 0 when it ran (the figures are the result, not a pass/fail).
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import torch
import torch.distributed as dist

from graph_trainer.parallel.compat import init_fake_process_group
from graph_trainer.parallel.fake_data import fill_collective_outputs, restore_collectives

WORLD = 8
SENTINEL = 7.0


def collective_outputs() -> dict[str, str]:
    """For each collective: 'copies input' if the output holds the input's values, 'untouched' if
    it still holds the sentinel it was filled with, else 'other'."""
    init_fake_process_group(WORLD, 0)
    x = torch.arange(WORLD * 4, dtype=torch.float32, device="cuda")
    found = {}

    def verdict(out: torch.Tensor, expected: torch.Tensor) -> str:
        if torch.equal(out, expected):
            return "copies input"
        return "untouched" if bool((out == SENTINEL).all()) else "other"

    out = torch.full((WORLD * x.numel(),), SENTINEL, device="cuda")
    dist.all_gather_into_tensor(out, x)
    found["c10d all_gather_into_tensor"] = verdict(out, x.repeat(WORLD))
    out = torch.full((4,), SENTINEL, device="cuda")
    dist.reduce_scatter_tensor(out, x)
    found["c10d reduce_scatter_tensor"] = verdict(out, x[:4])
    out = torch.full_like(x, SENTINEL)
    dist.all_to_all_single(out, x)
    found["c10d all_to_all_single"] = verdict(out, x)
    y = x.clone()
    dist.all_reduce(y)
    found["c10d all_reduce"] = "input kept" if torch.equal(y, x) else "changed"
    # the functional collectives (SimpleFSDP, DTensor, traced graphs) allocate their outputs: stale
    # memory shows as 'other', so the sentinel is planted by freeing a buffer of it first
    group, ops = dist.group.WORLD.group_name, torch.ops._c10d_functional
    for name, call, expected in (
            ("all_gather_into_tensor", lambda: ops.all_gather_into_tensor(x, WORLD, group), x.repeat(WORLD)),
            ("reduce_scatter_tensor", lambda: ops.reduce_scatter_tensor(x, "sum", WORLD, group), x[:4]),
            ("all_to_all_single", lambda: ops.all_to_all_single(x, [4] * WORLD, [4] * WORLD, group), x)):
        del out
        out = torch.full((WORLD * x.numel(),), SENTINEL, device="cuda")
        del out
        out = ops.wait_tensor(call())
        found[f"functional {name}"] = verdict(out, expected)
    # DTensor's Shard -> Shard on a GPU mesh: an all-to-all into empty_like, not a functional collective;
    # its fill is the rank's chunk repeated (what the CPU mesh's all-gather and chunk give)
    del out
    out = torch.full((WORLD * x.numel(),), SENTINEL, device="cuda")
    del out
    out = torch.ops._dtensor.shard_dim_alltoall(x, 0, 0, group)
    found["dtensor shard_dim_alltoall"] = verdict(out, x[:4].repeat(WORLD))
    dist.destroy_process_group()
    return found


def gemm_tflops(fill: str, n: int = 8192, seconds: float = 6.0) -> dict:
    """bf16 n^3 GEMM throughput after `seconds` of the same GEMM (the GPU at its steady power state)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    if fill == "nan":
        a.fill_(float("nan"))
        b.fill_(float("nan"))
    elif fill == "zeros":
        a.zero_()
        b.zero_()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    iters = 20
    warm = torch.cuda.Event(enable_timing=True)
    warm.record()
    while True:
        for _ in range(iters):
            a @ b
        end.record()
        end.synchronize()
        if warm.elapsed_time(end) > 1e3 * seconds:
            break
    start.record()
    for _ in range(iters * 5):
        a @ b
    end.record()
    end.synchronize()
    seconds_per = start.elapsed_time(end) / 1e3 / (iters * 5)
    clocks = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader"],
                            capture_output=True, text=True).stdout.strip()
    return {"fill": fill, "tflops": 2 * n**3 / seconds_per / 1e12, "sm_clock_and_power_after": clocks}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    torchs = collective_outputs()
    fill_collective_outputs()
    ours = collective_outputs()
    restore_collectives()
    result = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "fake_pg": torchs,
              "fake_pg_with_graph_trainer_kernels": ours,
              "gemm": [gemm_tflops(fill) for fill in ("random", "nan", "zeros", "random")]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fake_data_check.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
