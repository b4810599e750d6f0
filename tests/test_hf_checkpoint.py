"""Hugging Face checkpoints: save -> load round trips on other meshes, checkpoints written by
torchtitan's own adapters, export of a DCP step, refusal of a checkpoint of another shape.

How "identical" is checked: a loading run trains one step with `--optimizer.lr 0` (AdamW then leaves
every weight exactly as it is) and saves a DCP checkpoint, whose parameters must equal (==) the ones
saved by the run that wrote the HF checkpoint. Its loss must equal (==) the loss of a run on the same
mesh that starts from the saver's DCP step folder instead (`--checkpoint.initial_load_path` without
`--checkpoint.initial_load_in_hf`): same weights, batch and mesh, so the same bits.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from helpers import launch, losses, read_metrics, run_train

from graph_trainer import cli, models

SMALL = ["--training.batch_size", "4", "--training.seq_len", "64", "--model.n_layers", "2", "--compile.mode", "eager"]
MODELS = {
    "llama3": ["--model.name", "llama3", "--model.flavor", "debugmodel"],
    "deepseek_v3": ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"],
    "qwen3": ["--model.name", "qwen3", "--model.flavor", "debugmodel"],
}
# The 2-rank mesh a checkpoint saved on dp_shard=2 is loaded on: tensor parallel for dense models,
# expert parallel for DeepSeek V3 (its attention's heads do not split over tp here).
OTHER_MESH = {
    "llama3": ["--parallelism.dp_shard", "1", "--parallelism.tp", "2"],
    "deepseek_v3": ["--parallelism.dp_shard", "2", "--parallelism.ep", "2"],
    "qwen3": ["--parallelism.dp_shard", "1", "--parallelism.tp", "2"],
}
LOAD_ONE_STEP = ["--training.steps", "1", "--optimizer.lr", "0", "--checkpoint.enable"]


def dcp_model(folder: Path) -> dict[str, torch.Tensor]:
    """The `model.*` tensors of one of our DCP step folders, read in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = folder.parent / f"{folder.name}.pt"
    if not out.exists():
        dcp_to_torch_save(str(folder), str(out))
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state["model"].items()}


def parameter_names(name: str) -> set[str]:
    spec = models.get_spec(name)
    model = models.build_on_meta(spec, spec.args_for("debugmodel", 64, 2), "cpu")
    return {n for n, _ in model.named_parameters()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """`saved(model)` -> dump folder of a 2-step run on dp_shard=2 that saved step-2 as DCP and as HF (cached)."""
    runs: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in runs:
            folder = tmp_path_factory.mktemp(f"saved_{name}") / "run"
            run_train([*SMALL, *MODELS[name], "--training.steps", "2", "--checkpoint.enable", "--checkpoint.last_save_in_hf",
                       "--parallelism.dp_shard", "2"], folder, nproc=2)
            runs[name] = folder
        return runs[name]

    return get


def load_and_step(folder: Path, name: str, source: Path, in_hf: bool, nproc: int, mesh: list[str]) -> list[dict]:
    flags = ["--checkpoint.initial_load_path", str(source)] + (["--checkpoint.initial_load_in_hf"] if in_hf else [])
    return run_train([*SMALL, *MODELS[name], *LOAD_ONE_STEP, *mesh, *flags], folder, nproc=nproc)


def assert_same_parameters(name: str, loaded_run: Path, saved_run: Path) -> None:
    loaded, saved_ = dcp_model(loaded_run / "checkpoint" / "step-1"), dcp_model(saved_run / "checkpoint" / "step-2")
    names = parameter_names(name)
    assert names and names <= set(loaded)
    differing = [n for n in sorted(names) if not torch.equal(loaded[n], saved_[n])]
    assert not differing, f"{len(differing)} parameters differ after the HF round trip, e.g. {differing[0]}"


@pytest.mark.slow
@pytest.mark.parametrize("nproc, name", [(1, "llama3"), *((2, name) for name in MODELS)],
                         ids=lambda v: str(v))
def test_round_trip_gives_identical_parameters_and_next_loss(saved, tmp_path, name, nproc):
    """Every model's adapter onto another 2-rank mesh; one rank (the saver's shards gathered) for one model."""
    source = saved(name)
    hf = source / "checkpoint" / "step-2-hf"
    config = json.loads((hf / "config.json").read_text())
    assert config["graph_trainer"] == {"model": name, "flavor": "debugmodel", "n_layers": 2}
    mesh = OTHER_MESH[name] if nproc == 2 else []
    from_hf = load_and_step(tmp_path / "hf", name, hf, True, nproc, mesh)
    from_dcp = load_and_step(tmp_path / "dcp", name, source / "checkpoint" / "step-2", False, nproc, mesh)
    assert_same_parameters(name, tmp_path / "hf", source)
    assert losses(from_hf) == losses(from_dcp)
    # Trained weights, not a fresh initialisation: the same first batch scores clearly better than it
    # did at the saver's step 1 (on another mesh, so only up to float rounding comparable).
    assert losses(from_hf)[0] < losses(read_metrics(source))[0] - 0.05


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["jit", "aot"])
def test_round_trip_in_the_compiled_modes(saved, tmp_path, mode):
    """eager is above and aot_fx_trace with the auto-placed model below: the weights are loaded before the
    step is captured, and the captured step must start from them in every mode."""
    source = saved("llama3")
    flags = ["--compile.mode", mode]
    from_hf = load_and_step(tmp_path / "hf", "llama3", source / "checkpoint" / "step-2-hf", True, 1, flags)
    from_dcp = load_and_step(tmp_path / "dcp", "llama3", source / "checkpoint" / "step-2", False, 1, flags)
    assert_same_parameters("llama3", tmp_path / "hf", source)
    assert losses(from_hf) == losses(from_dcp)


@pytest.mark.slow
def test_export_writes_the_same_tensors_as_last_save_in_hf(saved, tmp_path, monkeypatch):
    """Also: an earlier export (only the files an export writes) is replaced without asking, in place
    (`--out .` leaves the working folder there); any other non-empty folder only with --overwrite."""
    from safetensors.torch import load_file

    source = saved("qwen3")
    step = str(source / "checkpoint" / "step-2")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "notes.txt").write_text("mine")
    assert cli.main(["export", "--checkpoint", step, "--out", str(hf)]) == 2
    assert (hf / "notes.txt").read_text() == "mine"
    assert cli.main(["export", "--checkpoint", step, "--out", str(hf), "--overwrite"]) == 0
    assert not (hf / "notes.txt").exists()
    (hf / "notes.txt").write_text("mine")
    assert cli.main(["export", "--checkpoint", step, "--out", str(hf)]) == 2
    (hf / "notes.txt").unlink()
    monkeypatch.chdir(hf)
    assert cli.main(["export", "--checkpoint", step, "--out", "."]) == 0
    assert Path.cwd().samefile(hf)
    exported = {k: v for f in sorted(hf.glob("*.safetensors")) for k, v in load_file(f).items()}
    at_end = {k: v for f in sorted((source / "checkpoint" / "step-2-hf").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert exported.keys() == at_end.keys()
    assert "model.layers.1.self_attn.q_norm.weight" in exported
    assert all(torch.equal(exported[k], at_end[k]) for k in exported)
    assert json.loads((hf / "config.json").read_text())["model_type"] == "qwen3"


# --out relative to a dump folder X holding X/checkpoint/step-{1,2}; the export reads step-2.
UNSAFE_OUT = {
    "the_checkpoint_root": ("X/checkpoint", "is the checkpoint folder"),
    "the_step_folder": ("X/checkpoint/step-2", "is the checkpoint folder"),
    "the_dump_folder": ("X", "holds the checkpoint folder"),
    "the_working_folder": (".", "holds the checkpoint folder"),
    "inside_the_step": ("X/checkpoint/step-2/hf", "lies inside the checkpoint folder"),
    "beside_the_steps": ("X/checkpoint/hf", "lies inside the checkpoint folder"),
    "a_non_empty_folder": ("notes", "is a non-empty folder that is not an earlier export"),
}


@pytest.mark.parametrize("case", list(UNSAFE_OUT))
def test_export_refuses_an_output_that_would_delete_checkpoints_or_files(case, tmp_path, monkeypatch, capsys):
    out, needle = UNSAFE_OUT[case]
    files = [tmp_path / "X" / "checkpoint" / f"step-{n}" / "meta.json" for n in (1, 2)] + [tmp_path / "notes" / "a.txt"]
    for f in files:
        f.parent.mkdir(parents=True)
        f.write_text("kept")
    monkeypatch.chdir(tmp_path)
    code = cli.main(["export", "--checkpoint", "X/checkpoint/step-2", "--out", out])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith("graph-trainer: error: --out "), lines
    assert needle in lines[0], lines
    assert all(f.read_text() == "kept" for f in files)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["X", "notes"]


def titan_checkpoint(folder: Path, name: str, flavor: str, shards: int) -> dict[str, torch.Tensor]:
    """A checkpoint written the way torchtitan's own HF conversion writes it: its model (as torchtitan
    defines the flavor, e.g. Qwen3's tied embedding), its adapter's `to_hf`, safetensors files
    (`shards` > 1: split with a model.safetensors.index.json). Returns the model's state dict."""
    from safetensors.torch import save_file
    from torchtitan.protocols.train_spec import get_train_spec

    train_spec = get_train_spec(name)
    args = copy.deepcopy(train_spec.model_args[flavor])
    args.n_layers, args.max_seq_len = 2, 64
    torch.manual_seed(7)
    model = train_spec.model_cls(args)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    hf = {k: v.contiguous() for k, v in train_spec.state_dict_adapter(args, None).to_hf(model.state_dict()).items()}
    folder.mkdir(parents=True)
    names = sorted(hf)
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {k: files[i * shards // len(names)] for i, k in enumerate(names)}
    for file in files:
        save_file({k: hf[k] for k in names if weight_map[k] == file}, str(folder / file))
    if shards > 1:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return model.state_dict()


@pytest.mark.parametrize("name, shards", [("llama3", 1), ("qwen3", 2)])
def test_checkpoint_of_torchtitans_adapter_loads(tmp_path, name, shards):
    reference = titan_checkpoint(tmp_path / "hf", name, "debugmodel", shards)
    if name == "qwen3":
        # torchtitan's Qwen3 debug model ties the output to the embedding, so its checkpoint has no
        # lm_head: our separate output projection starts from the embedding.
        assert "lm_head.weight" not in json.dumps(sorted(p.name for p in (tmp_path / "hf").iterdir()))
        reference["output.weight"] = reference["tok_embeddings.weight"]
    run_train([*SMALL, *MODELS[name], *LOAD_ONE_STEP, "--checkpoint.initial_load_path", str(tmp_path / "hf"),
               "--checkpoint.initial_load_in_hf"], tmp_path / "run")
    loaded = dcp_model(tmp_path / "run" / "checkpoint" / "step-1")
    names = parameter_names(name)
    assert names <= set(reference)
    assert all(torch.equal(loaded[n], reference[n]) for n in names), [n for n in names if not torch.equal(loaded[n], reference[n])][:3]


def test_checkpoint_of_another_shape_is_refused_naming_the_tensor(tmp_path):
    titan_checkpoint(tmp_path / "hf", "llama3", "debugmodel", 1)
    proc = launch(["train", "--job.dump_folder", str(tmp_path / "run"), *SMALL, *MODELS["llama3"], "--model.n_layers", "3",
                   "--checkpoint.initial_load_path", str(tmp_path / "hf"), "--checkpoint.initial_load_in_hf"])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "graph-trainer: error: HF checkpoint" in lines[0]
    assert "lacks model.layers.2.self_attn.q_proj.weight" in lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_checkpoint_of_another_architecture_is_refused_naming_the_tensor(tmp_path):
    titan_checkpoint(tmp_path / "hf", "qwen3", "debugmodel", 2)
    proc = launch(["train", "--job.dump_folder", str(tmp_path / "run"), *SMALL, *MODELS["llama3"],
                   "--checkpoint.initial_load_path", str(tmp_path / "hf"), "--checkpoint.initial_load_in_hf"])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    # Same names for the first tensors, but Qwen3's attention is 16 heads of 128 on a 256 model dim.
    assert "model.layers.0.self_attn.q_proj.weight has shape [2048, 256] there and [256, 256] here" in lines[0]


@pytest.mark.slow
def test_auto_placed_model_loads_hf_checkpoint(saved, tmp_path):
    source = saved("qwen3")
    auto = ["--parallelism.dp_shard", "2", "--compile.autoparallel", "--compile.mode", "aot_fx_trace"]
    from_hf = load_and_step(tmp_path / "hf", "qwen3", source / "checkpoint" / "step-2-hf", True, 2, auto)
    from_dcp = load_and_step(tmp_path / "dcp", "qwen3", source / "checkpoint" / "step-2", False, 2, auto)
    assert_same_parameters("qwen3", tmp_path / "hf", source)
    assert losses(from_hf) == losses(from_dcp)
