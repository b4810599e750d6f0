"""One H200: where a restart's 10-12 s before the trainer's init go. configs/llama3_8b.toml as rank 0 of 8 (fake
communication) is started cold (fills the caches), then started again three times on the same dump folder: plainly,
under `-X importtime` and under cProfile. Also `import torch` alone and with CUDA's init.

    python bench/results/2026-12-01-session30/call1/call1.py $OUT
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from runner import launch  # noqa: E402

out = Path(sys.argv[1])
dump = Path("/tmp/c1")
train = ["-m", "graph_trainer", "train", "--config", "configs/llama3_8b.toml", "--comm.mode", "fake",
         "--comm.fake_world_size", "8", "--parallelism.dp_shard", "8", "--training.random_tokens", "--training.steps",
         "3", "--job.dump_folder", str(dump)]
keys = ("step_cache", "time_to_first_step_s", "before_init_s", "init_s")
runs = {"cold": [], "restart": [], "importtime": ["-X", "importtime"],
        "cprofile": ["-m", "cProfile", "-o", str(out / "restart.prof")]}
for name, extra in runs.items():
    rc, output, first_step = launch([sys.executable, *extra, *train], dict(os.environ), 250)
    (out / f"{name}.txt").write_text(output)
    record = json.loads((dump / "metrics.jsonl").read_text().splitlines()[0])
    print(name, f"rc {rc}, launch to step 1 {first_step:.1f} s;", {k: record.get(k) for k in keys}, flush=True)
for code in ("import torch", "import torch; torch.cuda.init()", "import torch, torch._inductor.compile_fx",
             "import torchtitan.models.llama3", "import graph_trainer.trainer"):
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    print(f"{code}: {time.perf_counter() - t:.2f} s", flush=True)
