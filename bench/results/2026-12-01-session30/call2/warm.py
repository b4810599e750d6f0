"""configs/llama3_8b.toml as shipped (rank 0 of 8, fake communication, the in-graph optimizer), started cold and then
twice again on the same dump folder, each process reading Python bytecode compiled beforehand (as a pip-installed
machine has it; call2.sh sets PYTHONPYCACHEPREFIX): launch to the step-1 line and the step-1 record's start fields.

    python bench/results/2026-12-01-session30/call2/warm.py $OUT
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from runner import launch  # noqa: E402

out = Path(sys.argv[1])
dump = Path("/tmp/c2")
cmd = [sys.executable, "-m", "graph_trainer", "train", "--config", "configs/llama3_8b.toml", "--comm.mode", "fake",
       "--comm.fake_world_size", "8", "--parallelism.dp_shard", "8", "--training.random_tokens", "--training.steps", "4",
       "--job.dump_folder", str(dump)]
keys = ("step_cache", "time_to_first_step_s", "before_init_s", "init_s", "trace_s", "first_call_s")
for start in ("cold", "restart", "restart2"):
    rc, output, first_step = launch(cmd, dict(os.environ), 250)
    (out / f"{start}.txt").write_text(output)
    lines = (dump / "metrics.jsonl").read_text().splitlines()
    (out / f"{start}.metrics.jsonl").write_text("\n".join(lines) + "\n")
    first, last = json.loads(lines[0]), json.loads(lines[-1])
    print(start, f"rc {rc}, launch to step 1 {first_step:.1f} s;", {k: first.get(k) for k in keys},
          f"step {last['step']}: {last['tokens_per_second']:.0f} tokens/s", flush=True)
