"""The bad-input matrix: every misconfiguration exits with code 2 and one line on stderr that names
the fix, prints no traceback, and leaves an earlier run's dump folder and checkpoints as they were.

Most cases call `graph_trainer.cli.main` in this process (validation runs before any process group
exists; `trainer.run` is replaced by a tripwire so a case that slips through fails instead of
training); cases marked `proc` run the real entry point as one rank of a multi-rank job, with the
environment torchrun would set, to check the process's exit code.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from helpers import child_env, launch, run_train

from graph_trainer import cli

SMALL = ["--training.batch_size", "2", "--training.seq_len", "64", "--model.n_layers", "2", "--metrics.log_freq", "1"]


@dataclass
class Case:
    id: str
    argv: list[str]
    needle: str
    """A piece of the one-line message: what it must name."""
    world_size: int = 1
    setup: Callable[[Path, Path], None] | None = None
    """Prepares files: (earlier run's dump folder, a scratch folder)."""
    proc: bool = False
    command: str = "train"


def _write(name: str, text: str) -> Callable[[Path, Path], None]:
    def setup(prev: Path, scratch: Path) -> None:
        (scratch / name).write_text(text)

    return setup


def _parquet(path: Path, **columns: list) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)


def _truncate_latest(prev: Path, scratch: Path) -> None:
    data = sorted((prev / "checkpoint" / "step-2").glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[:100])


def _drop_meta(prev: Path, scratch: Path) -> None:
    (prev / "checkpoint" / "step-2" / "meta.json").unlink()


def _plan_of_other_mesh(prev: Path, scratch: Path) -> None:
    from graph_trainer.plan import cmd_plan

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WORLD_SIZE", "2")
        rc = cmd_plan(["--parallelism.dp_shard", "2", "--job.dump_folder", str(scratch / "plan_run"), *SMALL])
    assert rc == 0
    plans = list((scratch / "plan_run").rglob("*.json"))
    assert plans, "graph-trainer plan wrote no plan file"
    shutil.copy(plans[0], scratch / "plan.json")


def _pass_case(kind: str) -> Case:
    """A pass combination the registry declares invalid (found from its constraints, so it follows new passes)."""
    from graph_trainer.passes.registry import PASSES

    for spec in PASSES.values():
        if kind == "conflict" and spec.conflicts:
            other = spec.conflicts[0]
            return Case(f"pass_conflict_{spec.name}", ["--compile.mode", "aot_fx_trace", "--compile.passes", f"{spec.name},{other}"],
                        f"pass '{spec.name}' conflicts with '{other}'; remove one of them from --compile.passes")
        if kind == "requires" and spec.requires:
            return Case(f"pass_requires_{spec.name}", ["--compile.mode", "aot_fx_trace", "--compile.passes", spec.name],
                        f"requires '{spec.requires[0]}'; add '{spec.requires[0]}' before '{spec.name}' in --compile.passes")
        if kind == "mode" and "eager" not in spec.modes:
            return Case(f"pass_in_eager_{spec.name}", ["--compile.mode", "eager", "--compile.passes", spec.name],
                        f"pass '{spec.name}' cannot run; use --compile.mode aot_fx_trace")
    raise AssertionError(f"the pass registry declares no pass with a {kind} constraint")


CASES = [
    # command line
    Case("unknown_command", [], "use one of: train", command="trian"),
    Case("unknown_flag", ["--training.stepz", "5"], "unknown flag --training.stepz (did you mean '--training.steps'?)"),
    Case("unknown_section", ["--trainig.steps", "5"], "unknown flag --trainig.steps (did you mean '--training.steps'?)"),
    Case("positional_argument", ["steps=5"], "--training.steps 20"),
    Case("flag_without_value", ["--training.steps"], "needs a value"),
    Case("int_not_a_number", ["--training.steps", "ten"], "training.steps must be an integer"),
    Case("float_not_a_number", ["--optimizer.lr", "fast"], "optimizer.lr must be a number"),
    Case("bool_not_a_bool", ["--checkpoint.enable=maybe"], "checkpoint.enable must be true or false"),
    Case("mode_unknown", ["--compile.mode", "graph"], "compile.mode must be one of eager, jit, aot, aot_fx_trace, got 'graph'"),
    Case("backend_unknown", ["--compile.inductor_compilation", "max"], "compile.inductor_compilation must be one of"),
    Case("config_flag_without_file", ["--config"], "--config needs a file"),
    # TOML files
    Case("config_missing", ["--config", "{scratch}/nope.toml"], "pass an existing --config"),
    Case("toml_syntax", ["--config", "{scratch}/bad.toml"], "is not valid TOML", setup=_write("bad.toml", "[training\nsteps = 3\n")),
    Case("toml_unknown_section", ["--config", "{scratch}/s.toml"], "valid sections", setup=_write("s.toml", "[trainig]\nsteps = 3\n")),
    Case("toml_unknown_key", ["--config", "{scratch}/k.toml"], "did you mean 'steps'", setup=_write("k.toml", "[training]\nstep = 3\n")),
    Case("toml_wrong_type", ["--config", "{scratch}/t.toml"], "training.steps must be an integer", setup=_write("t.toml", "[training]\nsteps = 3.5\n")),
    Case("toml_key_outside_section", ["--config", "{scratch}/o.toml"], "must be a [section]", setup=_write("o.toml", "steps = 3\n")),
    # model and mesh
    Case("model_unknown", ["--model.name", "llama4"], "--model.name must be one of"),
    Case("flavor_unknown", ["--model.flavor", "3B"], "--model.flavor must be one of"),
    Case("n_layers_negative", ["--model.n_layers", "-1"], "model.n_layers must be >= 0"),
    Case("degrees_product", ["--parallelism.dp_shard", "3"], "product is 4", world_size=4),
    Case("world_not_divisible_by_tp", ["--parallelism.tp", "3"], "not divisible by dp_replicate * tp", world_size=4),
    Case("dp_shard_zero", ["--parallelism.dp_shard", "0"], "dp_shard must be -1 (fill) or >= 1"),
    Case("tp_zero", ["--parallelism.tp", "0"], "parallelism.tp must be >= 1"),
    Case("tp_not_dividing_heads", ["--parallelism.tp", "3"], "parallelism.tp=3 does not divide llama3 debugmodel's n_heads=16; pick a tp that divides it", world_size=3),
    Case("ep_on_dense_model", ["--parallelism.ep", "2"], "needs an MoE model; llama3 debugmodel has no experts (set --parallelism.ep 1)", world_size=2),
    Case("ep_not_dividing_experts", ["--model.name", "deepseek_v3", "--parallelism.ep", "3"], "does not divide deepseek_v3 debugmodel's 8 experts; pick an ep that divides it", world_size=3),
    Case("ep_not_dividing_ranks", ["--model.name", "deepseek_v3", "--parallelism.ep", "4", "--parallelism.dp_shard", "2"], "must divide dp_shard * tp", world_size=2),
    Case("seq_not_sharding_over_tp", ["--parallelism.tp", "2", "--training.seq_len", "33"], "use a multiple of 2", world_size=2),
    Case("batch_not_sharding_over_dp", ["--training.batch_size", "6"], "use a multiple of 4", world_size=4),
    Case("batch_not_sharding_over_microbatches", ["--training.batch_size", "4", "--training.gradient_accumulation_steps", "3"], "use a multiple of 3"),
    Case("embedding_vocab_without_dp_shard", ["--parallelism.embedding", "vocab"], "it shards over dp_shard, which is 1; use --parallelism.embedding gather"),
    Case("embedding_vocab_beside_tp", ["--parallelism.embedding", "vocab", "--parallelism.dp_shard", "2", "--parallelism.tp", "2"],
         "tp 2 shards the embedding's rows itself", world_size=4),
    Case("embedding_vocab_uneven", ["--parallelism.embedding", "vocab", "--parallelism.dp_shard", "3", "--training.batch_size", "3"],
         "the vocabulary (2048) does not split evenly over dp_shard 3", world_size=3),
    Case("embedding_vocab_auto_placed", ["--parallelism.embedding", "vocab", "--compile.autoparallel", "--parallelism.dp_shard", "2"],
         "the solver places the embedding itself (--compile.autoparallel)", world_size=2),
    Case("bf16_stored_computed_in_fp32", ["--training.dtype", "bfloat16", "--training.mixed_precision_param", "float32"],
         "--training.dtype bfloat16 stores and computes in bf16: drop --training.mixed_precision_param float32"),
    Case("mesh_error_on_rank_1", ["--parallelism.dp_shard", "3"], "product is 4", world_size=4, proc=True),
    # training numbers
    Case("steps_zero", ["--training.steps", "0"], "training.steps must be >= 1"),
    Case("seq_len_zero", ["--training.seq_len", "0"], "training.seq_len must be >= 1"),
    Case("max_norm_negative", ["--training.max_norm", "-1"], "training.max_norm must be >= 0"),
    Case("lr_negative", ["--optimizer.lr", "-0.1"], "optimizer.lr must be >= 0"),
    Case("warmup_negative", ["--lr_scheduler.warmup_steps", "-2"], "warmup_steps must be >= 0"),
    Case("min_lr_factor_above_one", ["--lr_scheduler.min_lr_factor", "1.5"], "min_lr_factor must be in [0, 1]"),
    Case("log_freq_zero", ["--metrics.log_freq", "0"], "metrics.log_freq must be >= 1"),
    Case("timeout_zero", ["--comm.timeout_seconds", "0"], "comm.timeout_seconds must be >= 1"),
    Case("compile_workers_below_auto", ["--compile.compile_workers", "-2"], "compile.compile_workers must be -1 (auto), 0 (none) or a count"),
    Case("profile_past_the_last_step", ["--profiling.enable", "--training.steps", "5", "--profiling.start_step", "5",
                                        "--profiling.steps", "2"], "--profiling.start_step 4 --profiling.steps 1"),
    Case("memory_snapshot_without_cuda", ["--profiling.memory_snapshot"],
         "--profiling.memory_snapshot records the CUDA allocator: run on GPUs, or drop it"),
    # files
    Case("dataset_missing", ["--training.dataset_path", "{scratch}/none.txt"], "pass an existing .txt/.jsonl/.parquet"),
    Case("dataset_is_a_json_file", ["--training.dataset_path", "{scratch}/data.json"], "data.json is not a supported format; a JSON file "
         "must become JSON Lines: one object with a 'text' field per line, in a .jsonl file", setup=_write("data.json", '[{"text": "a b"}]')),
    Case("dataset_csv", ["--training.dataset_path", "{scratch}/data.csv"], "data.csv is not a supported format; use .txt",
         setup=_write("data.csv", "text\na b\n")),
    Case("dataset_empty_file", ["--training.dataset_path", "{scratch}/e.jsonl"], "e.jsonl is empty; remove it or put documents in it",
         setup=_write("e.jsonl", "")),
    Case("dataset_only_blank_lines", ["--training.dataset_path", "{scratch}/b.txt"], "b.txt holds no document",
         setup=_write("b.txt", "\n  \n\n")),
    Case("dataset_folder_without_data", ["--training.dataset_path", "{scratch}"], "holds no file ending in .txt, .jsonl, .parquet",
         setup=_write("README.md", "a dataset card\n")),
    Case("dataset_jsonl_not_json", ["--training.dataset_path", "{scratch}/d.jsonl"], "d.jsonl:1: invalid JSON",
         setup=_write("d.jsonl", "plain text, not JSON\n")),
    Case("dataset_jsonl_without_text", ["--training.dataset_path", "{scratch}/d.jsonl"], "d.jsonl:1: expected an object with a string field 'text'",
         setup=_write("d.jsonl", '{"content": "a b"}\n')),
    Case("dataset_parquet_unreadable", ["--training.dataset_path", "{scratch}/d.parquet"], "d.parquet is not a readable Parquet file",
         setup=_write("d.parquet", "not parquet bytes")),
    Case("dataset_parquet_without_text", ["--training.dataset_path", "{scratch}/t.parquet"], "has no 'text' column (columns: body)",
         setup=lambda prev, scratch: _parquet(scratch / "t.parquet", body=["a b"])),
    Case("dataset_gzip_not_gzip", ["--training.dataset_path", "{scratch}/d.txt.gz"], "d.txt.gz cannot be read (Not a gzipped file",
         setup=_write("d.txt.gz", "plain text\n")),
    Case("dataset_not_utf8", ["--training.dataset_path", "{scratch}/l.txt"], "l.txt is not UTF-8 text",
         setup=lambda prev, scratch: (scratch / "l.txt").write_bytes("caf\xe9\n".encode("latin-1"))),
    Case("validation_dataset_json", ["--validation.enable", "--validation.dataset_path", "{scratch}/v.json"],
         "--validation.dataset_path: data file", setup=_write("v.json", "{}")),
    Case("tokenizer_missing", ["--model.tokenizer_path", "{scratch}/tok.json"], "pass a tokenizer file or its folder"),
    Case("tokenizer_not_a_tokenizer", ["--model.tokenizer_path", "{scratch}/vocab.json"], "is not a Hugging Face tokenizer file",
         setup=_write("vocab.json", '{"a": 0}')),
    Case("tokenizer_folder_without_one", ["--model.tokenizer_path", "{scratch}"], "must hold exactly one Hugging Face tokenizer file"),
    Case("initial_load_missing", ["--checkpoint.initial_load_path", "{scratch}/nope"], "is not a folder; pass a step folder a save wrote"),
    Case("initial_load_not_a_checkpoint", ["--checkpoint.initial_load_path", "{scratch}"], "pass a step folder a finished save wrote"),
    Case("initial_load_hf_without_weights", ["--checkpoint.initial_load_path", "{scratch}", "--checkpoint.initial_load_in_hf"],
         "pass a Hugging Face checkpoint folder"),
    Case("plan_not_a_plan", ["--compile.autoparallel", "--compile.autoparallel_plan", "{scratch}/p.json"], "write one with `graph-trainer plan`",
         setup=_write("p.json", "[1, 2]")),
    Case("dump_folder_is_a_file", ["--job.dump_folder", "{prev}/metrics.jsonl/run"], "is a file; pick another path"),
    Case("selective_ac_option", ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "x"], "'op' or an integer"),
    # passes
    Case("pass_unknown", ["--compile.mode", "aot_fx_trace", "--compile.passes", "bucketting_magic"], "unknown pass 'bucketting_magic' (did you mean 'auto_bucketing'?); see --compile.list_passes"),
    Case("async_tp_one_chunk", ["--compile.async_tp_chunks", "1"], "compile.async_tp_chunks must be >= 2 (slices of each rank's rows), got 1"),
    Case("async_tp_symm_mem_on_cpu", ["--compile.async_tp_lowering", "symm_mem"],
         "--compile.async_tp_lowering symm_mem needs CUDA GPUs and real communication: use chunked (or auto)"),
    _pass_case("conflict"),
    _pass_case("requires"),
    _pass_case("mode"),
    # checkpoints of the earlier run (steps 1 and 2 saved)
    Case("ckpt_interval_zero", ["--checkpoint.enable", "--checkpoint.interval", "0"], "checkpoint.interval must be >= 1"),
    Case("ckpt_keep_negative", ["--checkpoint.enable", "--checkpoint.keep_latest_k", "-1"], "keep_latest_k must be >= 0"),
    Case("ckpt_load_step_without_enable", ["--checkpoint.load_step", "1"], "add --checkpoint.enable"),
    Case("ckpt_load_step_missing", ["--checkpoint.enable", "--checkpoint.load_step", "7"], "complete steps: 1, 2"),
    Case("ckpt_other_model", ["--checkpoint.enable", "--model.n_layers", "3"], "holds another model"),
    Case("ckpt_other_seq_len", ["--checkpoint.enable", "--training.seq_len", "32"], "resume with --training.seq_len 64"),
    Case("ckpt_truncated", ["--checkpoint.enable"], "--checkpoint.fallback_to_previous", setup=_truncate_latest),
    Case("ckpt_without_meta", ["--checkpoint.enable"], "step-2 has no meta.json", setup=_drop_meta),
    Case("ckpt_folder_is_a_file", ["--checkpoint.enable", "--checkpoint.folder", "config.toml"], "is a file; pick another path"),
    Case("ckpt_truncated_on_rank_1", ["--checkpoint.enable", "--parallelism.dp_shard", "2"], "fallback_to_previous",
         world_size=2, setup=_truncate_latest, proc=True),
    Case("plan_of_other_mesh", ["--compile.autoparallel", "--compile.autoparallel_plan", "{scratch}/plan.json", "--parallelism.dp_shard", "4", "--training.batch_size", "8"],
         "was made for mesh (dp_replicate, dp_shard, tp) = (1, 2, 1), not (1, 4, 1); run `graph-trainer plan` with these --parallelism degrees",
         world_size=4, setup=_plan_of_other_mesh),
]


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory) -> Path:
    """A finished run with checkpoints at steps 1 and 2, the folder every case must leave alone."""
    folder = tmp_path_factory.mktemp("earlier") / "run"
    data = folder.parent / "data.txt"
    data.write_text("\n\n".join(f"document {i}: " + "the quick brown fox jumps over the lazy dog " * 20 for i in range(60)))
    run_train([*SMALL, "--training.dataset_path", str(data), "--training.steps", "2",
               "--checkpoint.enable", "--checkpoint.interval", "1"], folder, timeout=600)
    assert sorted(p.name for p in (folder / "checkpoint").iterdir()) == ["step-1", "step-2"]
    return folder


def _snapshot(folder: Path) -> dict[str, tuple[int, str]]:
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, hashlib.sha1(p.read_bytes()).hexdigest())
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_bad_input_exits_2_with_one_line(case: Case, earlier_run: Path, tmp_path: Path, monkeypatch, capsys):
    prev, scratch = tmp_path / "prev", tmp_path / "scratch"
    shutil.copytree(earlier_run, prev)
    scratch.mkdir()
    if case.setup is not None:
        case.setup(prev, scratch)
    before = _snapshot(prev)
    flags = [a.format(prev=prev, scratch=scratch) for a in case.argv]
    argv = [case.command, "--job.dump_folder", str(prev), *SMALL, *flags]

    if case.proc:
        rank = case.world_size - 1
        env = child_env(WORLD_SIZE=str(case.world_size), RANK=str(rank), LOCAL_RANK=str(rank))
        proc = launch(argv, env=env, timeout=300)
        code, err = proc.returncode, proc.stderr
        prefix = f"[rank {rank}] graph-trainer: error: "
    else:
        monkeypatch.setenv("WORLD_SIZE", str(case.world_size))
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("LOCAL_RANK", "0")

        def tripwire(cfg):
            raise AssertionError(f"{case.id}: validation let this configuration through to training")

        monkeypatch.setattr("graph_trainer.trainer.run", tripwire)
        try:
            code = cli.main(argv)
        except SystemExit as e:
            code = e.code
        err = capsys.readouterr().err
        prefix = "[rank 0] graph-trainer: error: " if case.world_size > 1 else "graph-trainer: error: "

    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, f"{case.id}: exit code {code}, stderr:\n{err}"
    assert "Traceback" not in err, err
    assert len(lines) == 1, f"{case.id}: expected one line on stderr, got:\n{err}"
    assert lines[0].startswith(prefix), lines[0]
    assert case.needle in lines[0], f"{case.id}: {case.needle!r} not in {lines[0]!r}"
    assert _snapshot(prev) == before, f"{case.id}: the earlier run's folder changed"


def test_matrix_is_large_enough():
    assert len(CASES) >= 30
    assert len({c.id for c in CASES}) == len(CASES)


def test_a_fault_deep_in_the_data_is_one_line_too(tmp_path):
    """Validation reads the start of each data file; a bad line further in is found when the first run
    tokenizes the file (after the process group starts): one line and exit 2 all the same."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "fine"}\n' * 50 + "{broken\n")
    proc = launch(["train", "--job.dump_folder", str(tmp_path / "run"), *SMALL, "--training.dataset_path", str(data)], timeout=300)
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("graph-trainer: error: ") and "d.jsonl:51: invalid JSON" in lines[0], proc.stderr
