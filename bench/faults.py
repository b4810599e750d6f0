"""Faults on N ranks, each scenario's exact commands and outcome written to <out>/faults.md and faults.json.

    python bench/faults.py --nproc 2 --out DIR [--only kill,sigterm,resume,nan,corrupt] [--timeout-seconds 60]
                           [--relative-bound 1e-5] [-- TRAINER FLAGS...]

Scenarios (`--only` picks some; a scenario that needs another's run makes it):
- kill:    rank 1 is killed (SIGKILL) before step 2; every other rank exits with code 4 within
           --comm.timeout_seconds of its death (and GRACE_S to exit), with one error line, and nothing hangs.
- sigterm: every rank gets SIGTERM before step 2; they finish step 2, save a checkpoint of it and exit 0.
- resume:  sigterm's checkpoint (saved on N ranks) resumes on 1 rank, which stops at step 4 (SIGTERM again);
           that checkpoint resumes on N ranks to the end. Every step is compared with an uninterrupted N-rank
           run: the same LR bit for bit; losses within --relative-bound, since a mesh of another size sums the
           loss and gradients in another order (a wrong data position or state is off by far more).
- nan:     a NaN weight before step 3: every rank exits 3, the checkpoint of step 2 stays the latest.
- corrupt: a byte flipped in the latest checkpoint: refused (exit 2, one line) without
           --checkpoint.fallback_to_previous; with it, the run resumes from the one before and continues
           bit for bit like the uninterrupted run.

Each rank is its own process with the variables torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), no torchrun in between: its exit code would hide the ranks'. Faults are injected with the
trainer's test-only environment variables (`trainer.inject_test_faults`). The trainer picks NCCL when CUDA is
there and gloo otherwise, so the same command runs on GPUs and in the CPU test suite (tests/test_faults.py).
Trailing flags go to every training command after the script's own (later flags win). Exit 0 when every
scenario held, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from graph_trainer.checkpoint import complete_checkpoints  # noqa: E402
from graph_trainer.metrics import read_metrics  # noqa: E402

BASE_FLAGS = ["--model.n_layers", "2", "--training.batch_size", "4", "--training.seq_len", "64", "--compile.mode", "eager",
              "--compile.inductor_compilation", "none", "--metrics.log_freq", "1"]
STEPS = 6
RELATIVE_BOUND = 1e-5
"""Default loss bound of a resume on a mesh of another size: 2 -> 1 -> 2 ranks on CPU in fp32 measured 1.7e-6 at most.
In bf16 (the GPU default) the gradients round differently as well: --relative-bound, or train in fp32
(-- --training.mixed_precision_param float32)."""
GRACE_S = 30
"""A rank that waits on a dead peer gives up when the collective times out; tearing down the process takes a moment more."""
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    """For ranks started without torchrun, which need a MASTER_PORT up front."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment without a launcher's rank variables; one OpenMP thread a rank, as torchrun sets."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


class Watched:
    """A child process whose stderr is read as it comes: its lines, when `marker` first appeared, when it exited."""

    def __init__(self, cmd: list[str], env: dict[str, str], marker: str = "step:    1 ", shown_env: dict[str, str] | None = None):
        self.cmd = cmd
        self.shown_env = shown_env or {}
        """The variables set for this process on top of the caller's environment (for the record of the command)."""
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.marker = marker
        self.marker_time: float | None = None
        self.exit_time: float | None = None
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            if self.marker_time is None and self.marker in line:
                self.marker_time = time.monotonic()
            self.lines.append(line)

    def poll(self) -> int | None:
        code = self.proc.poll()
        if code is not None and self.exit_time is None:
            self.exit_time = time.monotonic()
        return code

    def wait(self, timeout: float) -> tuple[int, float]:
        """Exit code, and seconds from the marker line to the exit."""
        code = self.proc.wait(timeout=timeout)
        self.poll()
        self.reader.join(timeout=10)
        assert self.marker_time is not None, "".join(self.lines[-40:])
        return code, self.exit_time - self.marker_time

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.poll()

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def command(self) -> str:
        """The command as a shell line: its variables, then `python` for this interpreter."""
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in self.shown_env.items()), "python", *map(shlex.quote, self.cmd[1:])])


def launch_ranks(args: list[str], nproc: int, **extra: str) -> list[Watched]:
    """`python -m graph_trainer ARGS` once per rank, with the variables torchrun would set."""
    port = str(free_port())
    ranks = []
    for rank in range(nproc):
        launcher = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc)}
        if nproc > 1:
            launcher.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        ranks.append(Watched([sys.executable, "-m", "graph_trainer", *args], child_env(**launcher, **extra),
                             shown_env={**launcher, **extra}))
    return ranks


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "graph-trainer: error:" in line]


def steps_saved(folder: Path) -> list[int]:
    return [step for step, _ in complete_checkpoints(folder / "checkpoint")]


@dataclass
class Launch:
    commands: list[str]
    codes: list[int | None]
    seconds: float
    hung: bool
    """None: still running at the launch timeout (then killed)."""
    exit_after_s: list[float | None]
    """Each rank's exit, in seconds after the first rank's."""
    stderr: list[str]


@dataclass
class Scenario:
    name: str
    launches: list[Launch] = field(default_factory=list)
    checks: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c["ok"] for c in self.checks)

    def check(self, what: str, ok: bool, detail: object = "") -> bool:
        self.checks.append({"what": what, "ok": bool(ok), "detail": str(detail)})
        return bool(ok)


class Faults:
    def __init__(self, out: Path, nproc: int, flags: list[str], timeout_s: int, launch_timeout_s: int, relative_bound: float):
        self.out, self.nproc, self.flags = out, nproc, flags
        self.timeout_s, self.launch_timeout_s, self.relative_bound = timeout_s, launch_timeout_s, relative_bound
        self.memo: dict[str, Path] = {}

    def train(self, scenario: Scenario, folder: Path, nproc: int, *extra: str, env: dict[str, str] | None = None) -> Launch:
        """One training launch, waited for (its ranks killed if it outlives the launch timeout), recorded in `scenario`."""
        args = ["train", "--job.dump_folder", str(folder), *BASE_FLAGS, *self.flags, *extra]
        env = env or {}
        start = time.monotonic()
        ranks = launch_ranks(args, nproc, **env)
        deadline = start + self.launch_timeout_s
        # every rank polled each round (no short-circuit): each exit time is when that rank ended
        while [r.poll() for r in ranks].count(None) and time.monotonic() < deadline:
            time.sleep(0.05)
        codes = [r.poll() for r in ranks]
        exits = [r.exit_time for r in ranks]
        first_exit = min((t for t in exits if t is not None), default=None)
        for r in ranks:
            r.kill()
            r.reader.join(timeout=10)
        launch = Launch(
            commands=[r.command() for r in ranks], codes=codes,
            seconds=time.monotonic() - start, hung=None in codes,
            exit_after_s=[None if t is None else t - first_exit for t in exits],
            stderr=[r.stderr for r in ranks],
        )
        scenario.launches.append(launch)
        return launch

    def straight(self, scenario: Scenario) -> Path:
        """The uninterrupted N-rank run every other is compared with (checkpoints every 2 steps)."""
        if "straight" not in self.memo:
            folder = self.out / "runs" / "straight"
            launch = self.train(scenario, folder, self.nproc, "--training.steps", str(STEPS), "--checkpoint.enable",
                                "--checkpoint.interval", "2")
            scenario.check("the uninterrupted run finishes", launch.codes == [0] * self.nproc, launch.codes)
            self.memo["straight"] = folder
        return self.memo["straight"]

    def stopped(self, scenario: Scenario) -> Path:
        """N ranks stopped by SIGTERM before step 2 (no periodic checkpoint: only the signal saves)."""
        if "stopped" not in self.memo:
            folder = self.out / "runs" / "sigterm"
            launch = self.train(scenario, folder, self.nproc, "--training.steps", str(STEPS), "--checkpoint.enable",
                                "--checkpoint.interval", "1000", env={"GRAPH_TRAINER_SIGNAL_AT_STEP": "2:SIGTERM"})
            scenario.check("every rank exits 0", launch.codes == [0] * self.nproc, launch.codes)
            scenario.check("rank 0 says it stopped after step 2", "stopped after step 2 on a stop signal (SIGTERM)" in launch.stderr[0],
                           _last_line(launch.stderr[0]))
            scenario.check("a checkpoint of step 2, and only that one", steps_saved(folder) == [2], steps_saved(folder))
            self.memo["stopped"] = folder
        return self.memo["stopped"]


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _records(folder: Path, steps: range) -> list[dict]:
    return [r for r in read_metrics(folder) if r["step"] in steps]


def _compare(s: Scenario, what: str, got: list[dict], want: list[dict], bound: float | None) -> None:
    """`bound` None: losses bit for bit; else within that relative difference."""
    s.check(f"{what}: steps {[r['step'] for r in want]}", [r["step"] for r in got] == [r["step"] for r in want],
            [r["step"] for r in got])
    s.check(f"{what}: the same LR bit for bit", [r["lr"] for r in got] == [r["lr"] for r in want], [r["lr"] for r in got])
    diffs = [abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(got, want)]
    worst = max(diffs, default=0.0)
    if bound is None:
        s.check(f"{what}: losses bit for bit", [r["loss"] for r in got] == [r["loss"] for r in want], f"max relative diff {worst:.3g}")
    else:
        s.check(f"{what}: losses within {bound:g} relative", len(diffs) == len(want) and worst <= bound,
                f"max relative diff {worst:.3g}; bit for bit: {[r['loss'] for r in got] == [r['loss'] for r in want]}")


def kill(f: Faults, s: Scenario) -> None:
    launch = f.train(s, f.out / "runs" / "kill", f.nproc, "--training.steps", "20", "--comm.timeout_seconds", str(f.timeout_s),
                     env={"GRAPH_TRAINER_SIGNAL_AT_STEP": "2:SIGKILL:1"})
    s.check("no rank hangs", not launch.hung, f"{launch.seconds:.0f} s")
    s.check("rank 1 died of SIGKILL", launch.codes[1] == -signal.SIGKILL, launch.codes[1])
    others = [rank for rank in range(f.nproc) if rank != 1]
    s.check("every other rank exits 4", all(launch.codes[r] == 4 for r in others), launch.codes)
    late = [launch.exit_after_s[r] for r in others]
    s.check(f"... within --comm.timeout_seconds={f.timeout_s} (+{GRACE_S} s to exit) of the death",
            all(t is not None and t < f.timeout_s + GRACE_S for t in late),
            ", ".join("still running" if t is None else f"{t:.1f} s" for t in late))
    lines = error_lines(launch.stderr[0])
    s.check("rank 0: one error line naming the step and the timeout flag",
            len(lines) == 1 and "a collective failed at step 2" in lines[0] and f"--comm.timeout_seconds={f.timeout_s}" in lines[0], lines)
    s.check("rank 0: no traceback", "Traceback" not in launch.stderr[0])


def sigterm(f: Faults, s: Scenario) -> None:
    straight, stopped = f.straight(s), f.stopped(s)
    _compare(s, "steps before the signal", _records(stopped, range(1, 3)), _records(straight, range(1, 3)), bound=None)


def resume(f: Faults, s: Scenario) -> None:
    straight, stopped = f.straight(s), f.stopped(s)
    one = f.out / "runs" / "resume-1-rank"
    shutil.rmtree(one, ignore_errors=True)
    shutil.copytree(stopped, one)
    flags = ("--training.steps", str(STEPS), "--checkpoint.enable", "--checkpoint.interval", "1000")
    launch = f.train(s, one, 1, *flags, env={"GRAPH_TRAINER_SIGNAL_AT_STEP": "4:SIGTERM"})
    s.check(f"{f.nproc} ranks' checkpoint resumes on 1 rank, which stops after step 4 with a checkpoint",
            launch.codes == [0] and steps_saved(one) == [2, 4], (launch.codes, steps_saved(one)))
    _compare(s, f"1 rank after {f.nproc}", _records(one, range(3, 5)), _records(straight, range(3, 5)), bound=f.relative_bound)
    back = f.out / "runs" / f"resume-{f.nproc}-ranks"
    shutil.rmtree(back, ignore_errors=True)
    shutil.copytree(one, back)
    launch = f.train(s, back, f.nproc, *flags)
    s.check(f"1 rank's checkpoint resumes on {f.nproc} ranks to the end", launch.codes == [0] * f.nproc, launch.codes)
    _compare(s, f"{f.nproc} ranks after 1", _records(back, range(5, STEPS + 1)), _records(straight, range(5, STEPS + 1)),
             bound=f.relative_bound)


def nan(f: Faults, s: Scenario) -> None:
    folder = f.out / "runs" / "nan"
    launch = f.train(s, folder, f.nproc, "--training.steps", str(STEPS), "--checkpoint.enable", "--checkpoint.interval", "2",
                     env={"GRAPH_TRAINER_INJECT_NAN_AT_STEP": "3"})
    s.check("every rank exits 3", launch.codes == [3] * f.nproc, launch.codes)
    lines = error_lines(launch.stderr[0])
    s.check("rank 0: one error line naming the step and the fix",
            len(lines) == 1 and "step 3: loss nan" in lines[0] and "--optimizer.lr" in lines[0], lines)
    s.check("rank 0: no traceback", "Traceback" not in launch.stderr[0])
    s.check("the checkpoint of step 2 is kept, the latest", steps_saved(folder) == [2], steps_saved(folder))
    s.check("metrics stop at step 2", [r["step"] for r in read_metrics(folder)] == [1, 2], [r["step"] for r in read_metrics(folder)])


def corrupt(f: Faults, s: Scenario) -> None:
    straight = f.straight(s)
    folder = f.out / "runs" / "corrupt"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(straight, folder)
    # The same size: only the checksums the load verifies can tell.
    shard = sorted((folder / "checkpoint" / f"step-{STEPS}").glob("*.distcp"))[0]
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    flags = ("--training.steps", str(STEPS), "--checkpoint.enable", "--checkpoint.interval", "2")
    refused = f.train(s, folder, f.nproc, *flags)
    s.check("without --checkpoint.fallback_to_previous every rank exits 2", refused.codes == [2] * f.nproc, refused.codes)
    lines = error_lines(refused.stderr[0])
    s.check("... with one line naming the folder and the flag", len(lines) == 1 and f"step-{STEPS} is corrupt" in lines[0]
            and "--checkpoint.fallback_to_previous" in lines[0], lines)
    resumed = f.train(s, folder, f.nproc, *flags, "--checkpoint.fallback_to_previous")
    s.check("with it the run resumes from step 4", resumed.codes == [0] * f.nproc and "step-4 (step 4)" in resumed.stderr[0],
            resumed.codes)
    _compare(s, "steps after the fallback", _records(folder, range(5, STEPS + 1)), _records(straight, range(5, STEPS + 1)), bound=None)


SCENARIOS: dict[str, Callable[[Faults, Scenario], None]] = {"kill": kill, "sigterm": sigterm, "resume": resume, "nan": nan, "corrupt": corrupt}


def device() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (NCCL), torch {torch.__version__}"
    return f"CPU (gloo), torch {torch.__version__}"


def write_report(out: Path, command: str, nproc: int, flags: list[str], relative_bound: float, scenarios: list[Scenario]) -> None:
    summary = {"command": command, "nproc": nproc, "device": device(), "flags": [*BASE_FLAGS, *flags], "relative_bound": relative_bound,
               "scenarios": [{"name": s.name, "ok": s.ok, "checks": s.checks, "launches": [{**asdict(x), "stderr": [t[-4000:] for t in x.stderr]} for x in s.launches]} for s in scenarios]}
    (out / "faults.json").write_text(json.dumps(summary, indent=1))
    md = [f"# Faults on {nproc} ranks: {summary['device']}", "",
          f"`{command}`", "",
          "| scenario | held | checks |", "|---|---|---|"]
    md += [f"| {s.name} | {'yes' if s.ok else '**no**'} | {sum(c['ok'] for c in s.checks)}/{len(s.checks)} |" for s in scenarios]
    for s in scenarios:
        md += ["", f"## {s.name}", ""]
        for i, launch in enumerate(s.launches, 1):
            codes = ", ".join(f"rank {r}: {c}" for r, c in enumerate(launch.codes))
            md += [f"Launch {i} ({launch.seconds:.0f} s{', HUNG: killed' if launch.hung else ''}; exit codes {codes}):", "", "```"]
            md += launch.commands + ["```", ""]
        md += [f"- {'ok' if c['ok'] else 'FAILED'}: {c['what']}" + (f" ({c['detail']})" if c["detail"] else "") for c in s.checks]
    (out / "faults.md").write_text("\n".join(md) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = shlex.join(["python", "bench/faults.py", *argv])
    flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks of the multi-rank runs (>= 2)")
    parser.add_argument("--out", type=Path, required=True, help="folder for faults.md, faults.json and the runs")
    parser.add_argument("--only", default=",".join(SCENARIOS), help=f"comma-separated scenarios of {', '.join(SCENARIOS)}")
    parser.add_argument("--timeout-seconds", type=int, default=60, help="--comm.timeout_seconds of the kill scenario")
    parser.add_argument("--launch-timeout-seconds", type=int, default=900, help="a launch still running after this has hung")
    parser.add_argument("--relative-bound", type=float, default=RELATIVE_BOUND, help="loss bound of resumes on another number of ranks")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or args.nproc < 2:
        why = f"unknown scenario {unknown[0]!r}; pick from {', '.join(SCENARIOS)}" if unknown else "--nproc must be >= 2"
        print(f"faults.py: error: {why}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.out / "runs", ignore_errors=True)
    faults = Faults(args.out, args.nproc, flags, args.timeout_seconds, args.launch_timeout_seconds, args.relative_bound)
    done = []
    for name in names:
        scenario = Scenario(name)
        SCENARIOS[name](faults, scenario)
        done.append(scenario)
        print(f"{name}: {'held' if scenario.ok else 'FAILED'}", flush=True)
        for c in scenario.checks:
            print(f"  {'ok' if c['ok'] else 'FAILED'}: {c['what']}" + (f" ({c['detail']})" if c["detail"] else ""), flush=True)
    write_report(args.out, command, args.nproc, flags, args.relative_bound, done)
    return 0 if all(s.ok for s in done) else 1


if __name__ == "__main__":
    sys.exit(main())
