"""bench/: what the GPU suites launch and read back, checked on the CPU (the suites themselves run on the device).
The multi-GPU suite's two sides get the same work per rank; torchtitan's and NCCL's log lines parse; a curve
compared against its reference is judged by the stated bound."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from logs import main_protocols, nccl_protocols, titan_records  # noqa: E402
from runner import against_reference, command, launch  # noqa: E402
from runs import REPO, WARMUP_STEPS, Run, last_measured_step  # noqa: E402
from suites import SUITES  # noqa: E402


def _flag(args: list[str], name: str, default: str = "") -> str:
    return args[args.index(name) + 1] if name in args else default


@pytest.mark.parametrize("gpus", [2, 4])
def test_multi_same_work_per_rank(gpus):
    """Per group: every run on all the GPUs; ours' GLOBAL batch is torchtitan's per-rank batch times the dp degree;
    same sequence, layers (torchtitan's `<flavor>-<n>L`), mesh and AC; every group has its torchtitan compile."""
    runs = SUITES["multi"](10, gpus)
    for group in dict.fromkeys(r.group for r in runs):
        members = [r for r in runs if r.group == group]
        assert "titan compile" in {r.name for r in members}
        titan = next(r.args for r in members if r.trainer == "titan")
        dp, tp = int(_flag(titan, "--parallelism.data_parallel_shard_degree")), int(_flag(titan, "--parallelism.tensor_parallel_degree"))
        pp = int(_flag(titan, "--parallelism.pipeline_parallel_degree", "1"))
        assert dp * tp * pp == gpus
        flavor, _, layers = _flag(titan, "--model.flavor").partition("-")
        for r in members:
            assert r.nproc == gpus
            if r.trainer == "titan":
                assert _flag(r.args, "--model.flavor") == _flag(titan, "--model.flavor")
                continue
            a = r.args
            assert int(_flag(a, "--training.batch_size")) == int(_flag(titan, "--training.local_batch_size")) * dp
            assert (_flag(a, "--parallelism.dp_shard"), _flag(a, "--parallelism.tp")) == (str(dp), str(tp))
            assert _flag(a, "--parallelism.ep", "1") == _flag(titan, "--parallelism.expert_parallel_degree", "1")
            assert (_flag(a, "--model.flavor"), _flag(a, "--model.n_layers", "0")) == (flavor, layers.rstrip("L") or "0")
            assert _flag(a, "--training.seq_len") == _flag(titan, "--training.seq_len")
            assert _flag(a, "--parallelism.pp", "1") == str(pp)
            if pp > 1:
                # the same schedule over the same microbatches, and stages holding every layer once
                assert _flag(a, "--parallelism.pp_schedule") == _flag(titan, "--parallelism.pipeline_parallel_schedule")
                micro = int(_flag(titan, "--training.local_batch_size")) // int(_flag(titan, "--parallelism.pipeline_parallel_microbatch_size"))
                assert int(_flag(a, "--parallelism.pp_microbatches")) == micro
                split = _flag(a, "--parallelism.pp_layers_per_stage")
                assert split == "balanced" or sum(map(int, split.split(","))) == int(layers.rstrip("L"))
            if "--config" in a:
                # a production config as shipped: its activation checkpointing is the file's
                assert "--activation_checkpoint.mode" not in a and (REPO / _flag(a, "--config")).is_file()
                continue
            # the last AC flags win on both sides; the memory policy's runs hold torchtitan's memory, not its AC
            ours_ac = a[len(a) - a[::-1].index("--activation_checkpoint.mode")]
            if " memory_budget " in r.name:
                assert ours_ac == "memory_budget" and _flag(a, "--activation_checkpoint.memory_budget") == r.name.split(" memory_budget ")[1].split()[0]
            else:
                assert ours_ac == titan[len(titan) - titan[::-1].index("--activation_checkpoint.mode")]


def test_numerics_runs_start_from_the_export(tmp_path):
    """The curves of both trainers start from the Hugging Face folder the export run wrote; torchtitan loads it only
    with checkpointing on and must save nothing."""
    runs = [r for r in SUITES["numerics"](10, 2) if r.group == "1B same weights"]
    export = tmp_path / "1B_same_weights-gt_export" / "checkpoint" / "step-1-hf"
    export.mkdir(parents=True)
    for r in runs[1:]:
        cmd = command(r, tmp_path)
        assert cmd[cmd.index("--checkpoint.initial_load_path") + 1] == str(export) and "--checkpoint.initial_load_in_hf" in cmd
        assert ("--checkpoint.load_only" in cmd) == (r.trainer == "titan")
    assert "--checkpoint.last_save_in_hf" in runs[0].args


def test_titan_lines_of_rank_0_only():
    output = ("[rank1]:[titan] 00:00:01 - root - INFO - \x1b[31mstep:  1  \x1b[32mloss: 12.00000  \x1b[33mgrad_norm:  9.0000  "
              "\x1b[34mmemory: 30.00GiB(40.00%)  tps: 1,000  tflops: 1.00  mfu: 0.10%\x1b[39m\n"
              "[rank0]:[titan] 00:00:01 - root - INFO - step:  1  loss: 11.50000  grad_norm:  8.5000  memory: 31.50GiB(40.00%)  "
              "tps: 52,058  tflops: 400.00  mfu: 44.30%\n")
    assert titan_records(output) == [{"step": 1, "loss": 11.5, "grad_norm": 8.5, "reserved_memory_gib": 31.5,
                                      "tokens_per_second": 52058.0, "mfu": 44.3}]


def test_titan_line_of_a_pipeline_rank_without_the_loss():
    """Under pipeline parallelism rank 0 holds the first stage and logs the loss as -1: its step is still measured."""
    output = "[rank0]:[titan] step:  3  loss: -1.0000  grad_norm:  2.5000  memory: 40.00GiB(50.00%)  tps: 9,000  tflops: 300.00  mfu: 30.10%\n"
    assert titan_records(output) == [{"step": 3, "loss": -1.0, "grad_norm": 2.5, "reserved_memory_gib": 40.0,
                                      "tokens_per_second": 9000.0, "mfu": 30.1}]


def test_nccl_protocols():
    output = ("node:1:1 [0] NCCL INFO AllGather: 67108864 Bytes -> Algo RING proto SIMPLE channel{Lo..Hi}={0..23}\n"
              "[rank0]:node:1:1 [0] NCCL INFO AllGather: 1048576 Bytes -> Algo RING proto LL channel{Lo..Hi}={0..1}\n"
              "node:1:1 [0] NCCL INFO ReduceScatter: 4096 Bytes -> Algo RING proto LL channel{Lo..Hi}={0..0} comm 0x55a7\n"
              "node:1:1 [0] NCCL INFO ncclCommInitRank comm 0x55a7 rank 0 nranks 2 - Init COMPLETE\n")
    protocols = nccl_protocols(output)
    assert protocols == {"AllGather": {"SIMPLE": {"calls": 1, "bytes": 67108864}, "LL": {"calls": 1, "bytes": 1048576}},
                         "ReduceScatter": {"LL": {"calls": 1, "bytes": 4096}}}
    assert main_protocols(protocols) == "AllGather SIMPLE 98%; ReduceScatter LL 100%"


def test_curve_against_reference_bound():
    """Mean and max |loss difference| over the curve against (mean, max) of the bound: one step off by more than the
    max fails a curve whose mean is within."""
    losses = [12.0 - 0.02 * i for i in range(10)]
    ref = {"name": "titan eager", "group": "g", "losses": losses, "grad_norms": [1.0] * 10}
    run = Run("gt eager", "gt", 2, [], bitwise_with="titan eager", group="g", loss_bound=(5e-3, 2e-2))
    close = against_reference(run, {"losses": [losses[0] + 1e-3, *losses[1:]], "grad_norms": [1.0] * 10}, [ref])
    assert close["within_loss_bound"] and not close["bitwise_equal"]
    assert close["first_step_abs_loss_diff"] == close["max_abs_loss_diff"] == pytest.approx(1e-3)
    off = against_reference(run, {"losses": [*losses[:9], losses[9] + 0.03], "grad_norms": [1.0] * 10}, [ref])
    assert off["mean_abs_loss_diff"] < 5e-3 < 2e-2 < off["max_abs_loss_diff"] and not off["within_loss_bound"]
    same = against_reference(run, dict(ref), [ref])
    assert same["bitwise_equal"] and same["max_abs_loss_diff"] == 0.0
    assert against_reference(run, dict(ref), []) == {"bitwise_with": "titan eager", "reference_missing": True}


def test_timeout_ends_every_process_of_the_run(tmp_path):
    """A hung run is killed whole at the timeout, keeping its output and the time its step-1 line came: here a
    launcher whose child runs in a session of its own, as torchrun starts its ranks."""
    pid_file = tmp_path / "child.pid"
    script = (f"import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
              f"start_new_session=True); "
              f"open({str(pid_file)!r}, 'w').write(str(c.pid)); print('step:    1  loss: 7.0', flush=True); time.sleep(60)")
    started = time.perf_counter()
    # 5 s: time for two Python starts on a loaded machine before the timer fires
    rc, output, first_step = launch([sys.executable, "-c", script], dict(os.environ), timeout=5)
    assert rc == -9 and output.startswith("timed out after 5s") and "step:    1" in output
    assert first_step is not None and first_step < 5 <= time.perf_counter() - started < 30
    stat = Path(f"/proc/{pid_file.read_text()}/stat")
    for _ in range(50):
        # gone, or a zombie its new parent has yet to reap
        if not stat.exists() or stat.read_text().split(") ")[1].startswith("Z"):
            break
        time.sleep(0.1)
    else:
        pytest.fail("the run's child process survived the timeout")


def test_too_few_steps_refused_before_any_run(tmp_path):
    """A profiled run measures the steps between the warm-up and its last two (profiler warm-up, recorded step): a
    `--steps` that leaves one of the selected runs nothing to measure is refused up front, with the run named."""
    argv = [sys.executable, str(REPO / "bench" / "run.py"), "--suite", "multi", "--gpus", "2", "--groups", "1B dp2",
            "--out", str(tmp_path), "--print-commands"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    short = subprocess.run([*argv, "--steps", "5"], capture_output=True, text=True, env=env)
    assert short.returncode == 2 and short.stderr.strip().splitlines() == [
        "bench/run.py: error: --steps 5 leaves 1B dp2: gt aot_fx_trace full (5 steps, profiled) no step to measure after "
        "the 3-step warm-up: pass a larger --steps"]
    assert subprocess.run([*argv, "--steps", "6"], capture_output=True, env=env).returncode == 0


@pytest.mark.parametrize("steps", [1, 6])
def test_scale_runs_measure_a_step_at_any_steps(steps):
    """The scale suite's floor on its runs' steps leaves every run, profiled or not, a step to measure."""
    for run in SUITES["scale"](steps, 1):
        assert last_measured_step(run) > WARMUP_STEPS, (run.group, run.name)


def test_cold_rounds_rotate_the_order_and_keep_every_row_as_it_ends(tmp_path, monkeypatch):
    """Each round starts one config later, so no config always runs first; a run's row is on disk as soon as it ends
    (a call cut short keeps it), with the step-1 start-up figures only, and the logs end packed in logs.tgz."""
    import tarfile

    import runner

    seen = []

    def launch_cold(run, runs_dir, timeout, env=None):
        seen.append((run, env))
        if len(seen) > 1:
            assert len(json.loads((tmp_path / "rows.json").read_text())) == len(seen) - 1
        return tmp_path, 0, f"log of {run}", 10.0 + len(seen)

    monkeypatch.setattr(runner, "warm_imports", lambda: None)
    monkeypatch.setattr(runner, "launch_cold", launch_cold)
    monkeypatch.setattr(runner, "records", lambda run, dump, output: [{"tokens_per_second": 9.6, "trace_s": 1.5, "loss": 2.0},
                                                                     {"tokens_per_second": 20.2}])
    configs = {"a, first": ("A", {}), "b": ("B", {"X": "1"}), "c": ("C", {})}
    rows = runner.cold_rounds(configs, 3, tmp_path / "runs", tmp_path, 60)
    assert [r["config"] for r in rows] == ["a, first", "b", "c", "b", "c", "a, first", "c", "a, first", "b"]
    assert seen[1] == ("B", {"X": "1"}) and [r["round"] for r in rows] == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert rows[0] == {"round": 1, "config": "a, first", "rc": 0, "launch_to_step1_s": 11.0, "tokens_per_second": [10, 20],
                       "trace_s": 1.5}
    assert json.loads((tmp_path / "rows.json").read_text()) == rows
    with tarfile.open(tmp_path / "logs.tgz") as logs:
        assert sorted(logs.getnames()) == sorted(f"r{r}-{n}.log" for r in (1, 2, 3) for n in ("afirst", "b", "c"))
        assert logs.extractfile("r2-b.log").read() == b"log of B"
    assert not list(tmp_path.glob("*.log"))
