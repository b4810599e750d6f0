"""Defaults are the product: `graph-trainer train` with no mode flag traces the step (aot_fx_trace),
bitwise like eager on CPU; multi-rank traced jobs get the overlap schedule without asking; every
production config validates for the GPU counts its comment names."""

import re
from pathlib import Path

import pytest

from graph_trainer.config import ConfigError, load_toml, parse_args
from graph_trainer.defaults import OVERLAP_SCHEDULE, for_record, resolve
from graph_trainer.units import GiB, fill_device, parse_memory_budget
from graph_trainer.validate import validate

from helpers import cached_run, grad_norms, losses, read_metrics

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
PRODUCTION = ("llama3_8b", "llama3_70b", "llama3_405b", "deepseek_v3_16b", "deepseek_v3_671b", "qwen3_8b", "qwen3_30b_a3b")


def test_auto_backend_and_schedule_resolve_per_device_and_ranks():
    cfg = parse_args([])
    assert cfg.compile.mode == "aot_fx_trace"
    assert resolve(cfg, "cuda", 1).compile.inductor_compilation == "full"
    assert resolve(cfg, "cpu", 1).compile.inductor_compilation == "none"
    assert resolve(cfg, "cpu", 1).compile.passes == []
    assert resolve(cfg, "cuda", 8).compile.passes == list(OVERLAP_SCHEDULE)
    # tensor parallelism alone shards no parameter over data-parallel ranks: no schedule, and on real GPUs async TP
    # (symmetric memory's fused ops); not on CPU, nor with fake communication (no peers), nor with pipeline stages
    tp = ["--parallelism.tp", "2", "--parallelism.dp_shard", "1"]
    assert resolve(parse_args(tp), "cuda", 2).compile.passes == ["async_tp", "tp_reduce_overlap"]
    assert resolve(parse_args(tp), "cpu", 2).compile.passes == []
    assert resolve(parse_args([*tp, "--comm.mode", "fake", "--comm.fake_world_size", "2"]), "cuda", 2).compile.passes == []
    assert resolve(parse_args(["--parallelism.tp", "2", "--parallelism.pp", "2"]), "cuda", 4).compile.passes == []
    assert resolve(parse_args(["--parallelism.tp", "2"]), "cuda", 8).compile.passes == [*OVERLAP_SCHEDULE, "async_tp",
                                                                                         "tp_reduce_overlap"]
    ap = parse_args(["--compile.inductor_compilation", "autoparallel_backend"])
    assert resolve(ap, "cuda", 8).compile.passes == ["separate_gather_group"]
    # the user's list is taken as it is; `none` is no pass at all, and is recorded as such
    assert resolve(parse_args(["--compile.passes", "auto_bucketing"]), "cuda", 8).compile.passes == ["auto_bucketing"]
    off = resolve(parse_args(["--compile.passes", "none"]), "cuda", 8)
    assert off.compile.passes == [] and for_record(off).compile.passes == ["none"]
    assert resolve(for_record(off), "cuda", 8).compile.passes == []
    eager = resolve(parse_args(["--compile.mode", "eager"]), "cuda", 8)
    assert eager.compile.passes == [] and eager.compile.inductor_compilation == "none"


def test_memory_budget_without_a_number_fills_the_device_less_a_margin():
    h100 = 79.1 * GiB
    assert parse_memory_budget("", h100, when_empty=fill_device) == pytest.approx(h100 - 0.08 * h100)
    assert parse_memory_budget("", 24 * GiB, when_empty=fill_device) == 20 * GiB
    assert parse_memory_budget("40GiB", h100, when_empty=fill_device) == 40 * GiB


def _gpu_counts(path: Path) -> list[int]:
    found = re.search(r"^# GPUs: ([\d, ]+)$", path.read_text(), re.M)
    assert found, f"{path.name} names no GPU count ('# GPUs: N')"
    return [int(n) for n in found.group(1).split(",")]


@pytest.mark.parametrize("name", PRODUCTION)
def test_production_configs_validate_for_their_gpu_counts(name):
    path = CONFIGS / f"{name}.toml"
    cfg = load_toml(path)
    # the traced step with clipping and AdamW compiled into it (measured fastest on 2 H200s, session 28)
    assert cfg.compile.mode == "aot_fx_trace" and cfg.compile.optimizer_in_graph and not cfg.training.deterministic
    for gpus in _gpu_counts(path):
        validate(cfg, world_size=gpus, device_type="cuda")
        resolved = resolve(cfg, "cuda", gpus)
        tp = ["async_tp", "tp_reduce_overlap"] if cfg.parallelism.tp > 1 else []
        assert resolved.compile.inductor_compilation == "full" and resolved.compile.passes == [*OVERLAP_SCHEDULE, *tp]


RUN = ("--training.steps", "3", "--training.batch_size", "4", "--training.seq_len", "64", "--metrics.log_freq", "1")


def test_default_run_traces_and_equals_eager_bitwise():
    traced = cached_run(RUN)
    eager = cached_run((*RUN, "--compile.mode", "eager"))
    recorded = load_toml(traced / "config.toml")
    assert recorded.compile.mode == "aot_fx_trace" and recorded.compile.inductor_compilation == "none"
    ref, got = read_metrics(eager), read_metrics(traced)
    assert "trace_s" in got[0] and "trace_s" not in ref[0]
    assert losses(got) == losses(ref) and grad_norms(got) == grad_norms(ref)


@pytest.mark.parametrize("flags", [("--parallelism.pp", "2", "--parallelism.dp_shard", "16"),
                                   ("--compile.inductor_compilation", "autoparallel_backend")],
                         ids=["pp", "autoparallel_backend"])
def test_a_production_config_names_how_to_turn_its_in_graph_optimizer_off(flags):
    """What the in-graph optimizer does not run with is refused in one line that names the negated flag (dropping
    a flag the user never passed is no fix), and with that flag the job validates."""
    argv = ["--config", str(CONFIGS / "llama3_70b.toml"), *flags]
    with pytest.raises(ConfigError) as err:
        validate(parse_args(argv), world_size=32, device_type="cuda")
    assert "pass --compile.no-optimizer_in_graph" in str(err.value) and "\n" not in str(err.value)
    validate(parse_args([*argv, "--compile.no-optimizer_in_graph"]), world_size=32, device_type="cuda")
