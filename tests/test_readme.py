"""Every command in README.md's ```bash blocks works as written.

Each command (continuation lines joined, `a && b` split) is classified:
- `graph-trainer ...` / `python -m graph_trainer ...`: run as written; it must exit 0 (and a `train` must
  log its last step);
- `torchrun ...` (also under `srun`): its graph-trainer arguments go through the up-front validation for
  the world size it names (`--nnodes` x `--nproc-per-node`, with `$SLURM_NNODES` from `#SBATCH --nodes`);
- the kinds in SKIPPED are not run, for the reason given there;
- anything else fails the test: a new kind of command needs a rule here.
The commands of one block run in order in one scratch folder that sees the repository's `configs/`.
"""

from __future__ import annotations

import math
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from graph_trainer.config import parse_args
from graph_trainer.metrics import read_metrics
from graph_trainer.validate import validate
from helpers import REPO, TIMEOUT_S, child_env

SKIPPED = {
    "pip": "installs packages: the test runs inside the installed environment it would build",
    "pytest": "runs the test suite, of which this test is a part",
    "shell_variable": "sets a shell variable for the commands after it (a Slurm host name)",
}


@dataclass(frozen=True)
class Command:
    block: int
    text: str
    kind: str
    argv: tuple[str, ...] = ()
    """graph-trainer's own arguments (after `graph-trainer` / `-m graph_trainer`)."""
    world_size: int = 1


def bash_blocks(readme: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", readme, flags=re.S | re.M)


def _lines(block: str) -> list[str]:
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def _launcher_args(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """A launcher's `--key value` / `--key=value` options up to `-m graph_trainer`, and what follows it."""
    options: dict[str, str] = {}
    i = 0
    while i < len(words) and words[i : i + 2] != ["-m", "graph_trainer"]:
        key, eq, value = words[i].partition("=")
        if eq:
            options[key] = value
            i += 1
        else:
            options[key] = words[i + 1] if i + 1 < len(words) else ""
            i += 2
    return options, words[i + 2 :]


def classify(block_index: int, text: str, env: dict[str, str]) -> Command:
    words = shlex.split(text)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        words = words[1:]
    if re.fullmatch(r"[A-Za-z_]\w*=\$\(.*\)", text):
        return Command(block_index, text, "shell_variable")
    if words[:1] == ["pip"]:
        return Command(block_index, text, "pip")
    if words[:3] == ["python", "-m", "pytest"] or words[:1] == ["pytest"]:
        return Command(block_index, text, "pytest")
    if words[:1] == ["graph-trainer"]:
        return Command(block_index, text, "run", tuple(words[1:]))
    if words[:3] == ["python", "-m", "graph_trainer"]:
        return Command(block_index, text, "run", tuple(words[3:]))
    if words[:1] == ["srun"]:
        words = words[words.index("torchrun"):] if "torchrun" in words else words
    if words[:1] == ["torchrun"]:
        options, argv = _launcher_args(words[1:])
        sizes = [options.get("--nnodes", "1"), options.get("--nproc-per-node", options.get("--nproc_per_node", "1"))]
        sizes = [re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), m.group(0)), s) for s in sizes]
        return Command(block_index, text, "torchrun", tuple(argv), math.prod(int(s) for s in sizes))
    return Command(block_index, text, "unknown")


def readme_commands() -> list[Command]:
    commands = []
    for i, block in enumerate(bash_blocks((REPO / "README.md").read_text())):
        nodes = re.search(r"^#SBATCH\b.*--nodes[= ](\d+)", block, flags=re.M)
        env = {"SLURM_NNODES": nodes.group(1)} if nodes else {}
        for line in _lines(block):
            commands.extend(classify(i, part.strip(), env) for part in line.split("&&"))
    return commands


COMMANDS = readme_commands()


def test_readme_has_the_documented_commands():
    kinds = {c.kind for c in COMMANDS}
    assert {"run", "torchrun", "pip", "pytest"} <= kinds, kinds
    unknown = [c.text for c in COMMANDS if c.kind == "unknown"]
    assert not unknown, f"README commands of a kind this test does not know (add a rule): {unknown}"


def test_classify_recognises_launchers_and_refuses_the_rest():
    sbatch = {"SLURM_NNODES": "2"}
    srun = classify(0, 'srun torchrun --nnodes "$SLURM_NNODES" --nproc-per-node 8 -m graph_trainer train --x.y 1', sbatch)
    assert (srun.kind, srun.world_size, srun.argv) == ("torchrun", 16, ("train", "--x.y", "1"))
    assert classify(0, "OMP_NUM_THREADS=1 python -m pytest -q", {}).kind == "pytest"
    assert classify(0, "python -m graph_trainer plan --a.b 2", {}).argv == ("plan", "--a.b", "2")
    assert classify(0, "docker run image", {}).kind == "unknown"
    assert classify(0, "accelerate launch train.py", {}).kind == "unknown"


def _run(cmd: Command, scratch: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "graph_trainer", *cmd.argv], cwd=scratch, env=child_env(),
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{cmd.text}\nexit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    if cmd.argv[0] == "train":
        cfg = parse_args(list(cmd.argv[1:]))
        records = read_metrics(scratch / cfg.job.dump_folder)
        assert records and records[-1]["step"] == cfg.training.steps, cmd.text


def _validate(cmd: Command) -> None:
    assert cmd.argv[:1] == ("train",), cmd.text
    degrees = validate(parse_args(list(cmd.argv[1:])), world_size=cmd.world_size)
    assert math.prod(degrees[:3]) == cmd.world_size, cmd.text


BLOCKS = sorted({c.block for c in COMMANDS})


# A block is a script: its commands run in order in one scratch folder (a later one may read what an
# earlier one wrote), which sees the repository's configs/. Running one trains, so such blocks are slow.
@pytest.mark.parametrize("block", [pytest.param(b, marks=pytest.mark.slow) if any(c.block == b and c.kind == "run" for c in COMMANDS)
                                   else b for b in BLOCKS], ids=[f"block{b}" for b in BLOCKS])
def test_readme_block(block: int, tmp_path, monkeypatch):
    (tmp_path / "configs").symlink_to(REPO / "configs")
    monkeypatch.chdir(tmp_path)
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    skipped = []
    for cmd in (c for c in COMMANDS if c.block == block):
        if cmd.kind in SKIPPED:
            skipped.append(f"{cmd.text!r}: {SKIPPED[cmd.kind]}")
        elif cmd.kind == "run":
            _run(cmd, tmp_path)
        elif cmd.kind == "torchrun":
            _validate(cmd)
        else:
            pytest.fail(f"README command of unknown kind (add a rule to tests/test_readme.py): {cmd.text}")
    if skipped:
        print("not run:\n" + "\n".join(skipped))
