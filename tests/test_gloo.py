"""CPU jobs run gloo with one worker thread per process group (parallel/compat.serial_gloo).

On torch's default two threads, two all-gathers of one group run at once and torch 2.13's gloo corrupts the
heap: the traced dp_shard 2 step of test_fx_trace died of it in CI (SIGSEGV at step 5). The crash is rare per
step, so this checks the cause's absence instead: every group of a job, made at start-up or later (mesh
dimensions, the all-gathers' twin), has one thread.
"""

from __future__ import annotations

import subprocess
import sys

from helpers import REPO, child_env

SCRIPT = """
import torch, torch.distributed as dist
from graph_trainer.trainer import DistEnv, init_distributed
init_distributed(DistEnv(0, 0, 1), torch.device("cpu"), 60)
later = dist.new_group([0])
cpu = torch.device("cpu")
print(dist.get_backend(), *(g._get_backend(cpu).options._threads for g in (dist.group.WORLD, later)))
dist.destroy_process_group()
"""


def test_every_group_of_a_cpu_job_runs_gloo_on_one_thread():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=child_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["gloo_serial", "1", "1"]
