"""One H200: the README's one-GPU command for configs/llama3_8b.toml as shipped (rank 0 of 8, fake communication, the
in-graph optimizer), started cold and then twice again on the same dump folder (the compile, trace and step caches
filled by the first start): seconds from launch to the step-1 line (bench/runner.launch), the step-1 record's cache
fields, the last step.

    python bench/results/2026-11-30-session29/call1/call1.py $OUT
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from runner import launch  # noqa: E402

out = Path(sys.argv[1])
dump = Path("/tmp/c1")
cmd = [sys.executable, "-m", "graph_trainer", "train", "--config", "configs/llama3_8b.toml", "--comm.mode", "fake",
       "--comm.fake_world_size", "8", "--parallelism.dp_shard", "8", "--training.random_tokens", "--training.steps", "9",
       "--job.dump_folder", str(dump)]
keys = ("step_cache", "compile_cache", "trace_cache", "compile_cache_entries_loaded", "compiled_blocks", "layers",
        "time_to_first_step_s", "before_init_s", "init_s", "trace_s", "first_call_s", "pass_inductor_decomposition_s")
for start in ("cold", "restart", "restart2"):
    rc, output, first_step = launch(cmd, dict(os.environ), 250)
    (out / f"{start}.txt").write_text(output)
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    (out / f"{start}.metrics.jsonl").write_text((dump / "metrics.jsonl").read_text())
    last = records[-1]
    print(start, f"rc {rc}, launch to step 1 {first_step:.1f} s;", {k: records[0].get(k) for k in keys},
          f"step {last['step']}: {last['tokens_per_second']:.0f} tokens/s, {last['peak_memory_gib']:.2f} GiB", flush=True)
