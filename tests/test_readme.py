"""Every command in the ```bash blocks of README.md and docs/*.md works as written.

Each command (continuation lines joined, `a && b` split) is classified:
- `graph-trainer ...` / `python -m graph_trainer ...`: run as written; it must exit 0 (and a `train` must
  log its last step);
- in a block whose first line is a `# GPU` comment, such a command is not run (this machine has no GPU): its
  `train` or `precompile` arguments go through the up-front validation for a CUDA device instead;
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
from dataclasses import dataclass
from pathlib import Path

import pytest

from graph_trainer.config import parse_args
from graph_trainer.metrics import read_metrics
from graph_trainer.precompile import fake_job, job_world_size
from graph_trainer.validate import validate
from helpers import REPO, launch

SKIPPED = {
    "pip": "installs packages: the test runs inside the installed environment it would build",
    "pytest": "runs the test suite, of which this test is a part",
    "shell_variable": "sets a shell variable for the commands after it (a Slurm host name)",
}


DOCUMENTS = ("README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")))
GPU_MARK = "# GPU"


@dataclass(frozen=True)
class Command:
    block: str
    """`<document>#<index of the bash block in it>`."""
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


def classify(block_index: str, text: str, env: dict[str, str], gpu: bool = False) -> Command:
    words = shlex.split(text)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        words = words[1:]
    if re.fullmatch(r"[A-Za-z_]\w*=\$\(.*\)", text):
        return Command(block_index, text, "shell_variable")
    if words[:1] == ["pip"]:
        return Command(block_index, text, "pip")
    if words[:3] == ["python", "-m", "pytest"] or words[:1] == ["pytest"]:
        return Command(block_index, text, "pytest")
    run = "gpu_run" if gpu else "run"
    if words[:1] == ["graph-trainer"]:
        return Command(block_index, text, run, tuple(words[1:]))
    if words[:3] == ["python", "-m", "graph_trainer"]:
        return Command(block_index, text, run, tuple(words[3:]))
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
    for document in DOCUMENTS:
        for i, block in enumerate(bash_blocks((REPO / document).read_text())):
            nodes = re.search(r"^#SBATCH\b.*--nodes[= ](\d+)", block, flags=re.M)
            env = {"SLURM_NNODES": nodes.group(1)} if nodes else {}
            gpu = block.startswith(GPU_MARK)
            for line in _lines(block):
                commands.extend(classify(f"{document}#{i}", part.strip(), env, gpu) for part in line.split("&&"))
    return commands


COMMANDS = readme_commands()


def test_readme_has_the_documented_commands():
    kinds = {c.kind for c in COMMANDS}
    assert {"run", "gpu_run", "torchrun", "pip", "pytest"} <= kinds, kinds
    unknown = [c.text for c in COMMANDS if c.kind == "unknown"]
    assert not unknown, f"commands of a kind this test does not know (add a rule): {unknown}"


def test_classify_recognises_launchers_and_refuses_the_rest():
    sbatch = {"SLURM_NNODES": "2"}
    srun = classify("", 'srun torchrun --nnodes "$SLURM_NNODES" --nproc-per-node 8 -m graph_trainer train --x.y 1', sbatch)
    assert (srun.kind, srun.world_size, srun.argv) == ("torchrun", 16, ("train", "--x.y", "1"))
    assert classify("", "OMP_NUM_THREADS=1 python -m pytest -q", {}).kind == "pytest"
    assert classify("", "python -m graph_trainer plan --a.b 2", {}).argv == ("plan", "--a.b", "2")
    assert classify("", "docker run image", {}).kind == "unknown"
    assert classify("", "accelerate launch train.py", {}).kind == "unknown"
    assert classify("", "graph-trainer train --a.b 1", {}, gpu=True).kind == "gpu_run"
    assert classify("", "torchrun --nproc-per-node 2 -m graph_trainer train", {}, gpu=True).kind == "torchrun"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_documents_link_to_files_and_headings_that_exist():
    broken = []
    for document in DOCUMENTS:
        path = REPO / document
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists():
                broken.append(f"{document}: {target}")
            elif anchor and anchor not in {_anchor(h) for h in re.findall(r"^#+ (.*)$", linked.read_text(), flags=re.M)}:
                broken.append(f"{document}: {target} (no such heading)")
    assert not broken, broken


def test_documents_name_source_files_that_exist():
    """A path like `passes/liveness.py` or tests/test_moe.py, from the repository or the package."""
    missing = []
    for document in DOCUMENTS:
        for path in set(re.findall(r"(?<![\w/.])((?:[\w-]+/)+[\w-]+\.py)\b", (REPO / document).read_text())):
            if not any((root / path).exists() for root in (REPO, REPO / "graph_trainer")):
                missing.append(f"{document}: {path}")
    assert not missing, missing


def _pip(text: str) -> list[str]:
    """A pip command's words without what changes nothing it installs (`python -m`, `-q`)."""
    words = shlex.split(text)
    return [w for w in (words[2:] if words[:2] == ["python", "-m"] else words) if w != "-q"]


def test_ci_runs_the_readme_install_and_test_commands():
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    ci_pip = [_pip(line) for line in ci if line.startswith("python -m pip install")]
    readme_pip = [_pip(c.text) for c in COMMANDS if c.kind == "pip" and c.block == "README.md#0"]
    assert ci_pip == readme_pip, (ci_pip, readme_pip)
    (pytest_cmd,) = [c.text for c in COMMANDS if c.kind == "pytest"]
    env, _, command = pytest_cmd.partition(" ")
    assert f"export {env}" in ci and command in ci, (pytest_cmd, ci)


def _run(cmd: Command, scratch: Path) -> None:
    # as `graph-trainer ...` in the scratch folder, started by the tests' launcher (helpers.launch): the same CLI entry
    # without importing torch again for each command
    proc = launch(list(cmd.argv), cwd=scratch)
    assert proc.returncode == 0, f"{cmd.text}\nexit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    if cmd.argv[0] == "train":
        cfg = parse_args(list(cmd.argv[1:]))
        records = read_metrics(scratch / cfg.job.dump_folder)
        assert records and records[-1]["step"] == cfg.training.steps, cmd.text


def _validate(cmd: Command) -> None:
    assert cmd.argv[:1] == ("train",), cmd.text
    cfg = parse_args(list(cmd.argv[1:]))
    degrees = validate(cfg, world_size=cmd.world_size)
    assert math.prod(degrees[:3]) * cfg.parallelism.pp == cmd.world_size, cmd.text


def _validate_on_gpu(cmd: Command) -> None:
    command, *flags = cmd.argv
    assert command in ("train", "precompile"), f"only `train` and `precompile` have a GPU rule: {cmd.text}"
    cfg = parse_args(flags)
    if command == "precompile":
        # as the command validates: one simulated rank of the job
        cfg = fake_job(cfg, job_world_size(cfg), 0)
    degrees = validate(cfg, device_type="cuda")
    world_size = cfg.comm.fake_world_size if cfg.comm.mode == "fake" else 1
    assert math.prod(degrees[:3]) == world_size, cmd.text


BLOCKS = sorted({c.block for c in COMMANDS})


# A block is a script: its commands run in order in one scratch folder (a later one may read what an
# earlier one wrote), which sees the repository's configs/. Running one trains, so such blocks are slow.
@pytest.mark.parametrize("block", [pytest.param(b, marks=pytest.mark.slow) if any(c.block == b and c.kind == "run" for c in COMMANDS)
                                   else b for b in BLOCKS], ids=BLOCKS)
def test_readme_block(block: str, tmp_path, monkeypatch):
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
        elif cmd.kind == "gpu_run":
            _validate_on_gpu(cmd)
        elif cmd.kind == "torchrun":
            _validate(cmd)
        else:
            pytest.fail(f"{block}: command of unknown kind (add a rule to tests/test_readme.py): {cmd.text}")
    if skipped:
        print("not run:\n" + "\n".join(skipped))
