"""One H200: each pipeline rank's compute under 1F1B and Interleaved1F1B, with fake communication (one process runs
one rank of the 2-rank job; receives return at once, so a step is the rank's compute and the schedule's host work,
no bubble). The multi suite's 8B-16L pp2 runs (8 microbatches of 1 x 4096, selective AC every 2nd layer, bf16,
full Inductor, the balanced split: 9 + 7 layers, or 4 + 5 on rank 0 and 5 + 2 on rank 1): on 2 H200s ours ran
Interleaved1F1B 0.9% slower than 1F1B with 4.5 points less idle (session 23), so its stages computed slower.

    python bench/results/2026-12-01-session30/call4/call4.py $OUT
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from runner import launch, warm_imports  # noqa: E402

out = Path(sys.argv[1])
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
os.environ["PYTHONPYCACHEPREFIX"] = "/tmp/pycache4"
base = ["--model.name", "llama3", "--model.flavor", "8B", "--training.seq_len", "4096", "--training.batch_size", "8",
        "--training.steps", "8", "--training.random_tokens", "--training.no-deterministic", "--metrics.log_freq", "1",
        "--model.n_layers", "16", "--parallelism.pp", "2", "--parallelism.pp_microbatches", "8", "--training.dtype",
        "bfloat16", "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2",
        "--compile.mode", "aot_fx_trace", "--compile.inductor_compilation", "full", "--parallelism.pp_layers_per_stage",
        "balanced", "--comm.mode", "fake", "--comm.fake_world_size", "2"]
warm_imports()
for schedule in ("1F1B", "Interleaved1F1B"):
    for rank in (0, 1):
        name = f"{schedule}-rank{rank}"
        dump = Path(f"/tmp/c4/{name}")
        cmd = [sys.executable, "-m", "graph_trainer", "train", *base, "--parallelism.pp_schedule", schedule,
               "--comm.fake_rank", str(rank), "--job.dump_folder", str(dump)]
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"/tmp/c4/{name}-inductor", "TRITON_CACHE_DIR": f"/tmp/c4/{name}-triton"}
        rc, output, first_step = launch(cmd, env, 200)
        (out / f"{name}.txt").write_text(output[-20000:])
        path = dump / "metrics.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        times = [round(r["step_time_s"] * 1000, 1) for r in records if "step_time_s" in r]
        first = records[0] if records else {}
        print(name, f"rc {rc}; step ms {times}; peak GiB {max((r.get('peak_memory_gib', 0) for r in records), default=None)};",
              {k: first.get(k) for k in ("pp_stage_layers", "compiled_blocks", "block_pieces")}, flush=True)
