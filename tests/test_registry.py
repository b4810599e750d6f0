"""The pass registry's declared constraints: each one refused by `check_passes` with a one-line
ConfigError naming the fix, two through the real CLI (exit 2, one line, no traceback), the
native backends' pass lists, the `--compile.list_passes` table, and that neither registry imports
its members."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from helpers import launch

from graph_trainer.backends import backend_names, get_backend
from graph_trainer.config import ConfigError, JobConfig
from graph_trainer.passes.listing import COLUMNS, registry_table
from graph_trainer.passes.registry import PASSES, graph_passes
from graph_trainer.passes.validate import check_passes


def cfg_for(passes: list[str], mode: str = "aot_fx_trace", backend: str = "none") -> JobConfig:
    cfg = JobConfig()
    cfg.compile.mode = mode
    cfg.compile.passes = passes
    cfg.compile.inductor_compilation = backend
    return cfg


def refused(passes: list[str], device: str = "cpu", **kw) -> str:
    with pytest.raises(ConfigError) as e:
        check_passes(cfg_for(passes, **kw), device)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_unknown_pass_names_the_closest_valid_one():
    msg = refused(["inductr_decomposition"])
    assert "unknown pass 'inductr_decomposition'" in msg and "did you mean 'inductor_decomposition'" in msg


def test_a_pass_listed_twice():
    assert "list it once" in refused(["inductor_decomposition", "inductor_decomposition"])


def test_missing_requirement():
    msg = refused(["full_inductor_compilation"])
    assert "requires 'inductor_decomposition'" in msg and "add 'inductor_decomposition' before" in msg


def test_requirement_after_the_pass_that_needs_it():
    msg = refused(["full_inductor_compilation", "inductor_decomposition"])
    assert "put 'inductor_decomposition' before 'full_inductor_compilation'" in msg


def test_conflict_between_user_passes():
    msg = refused(["inductor_decomposition", "full_inductor_compilation", "regional_inductor"])
    assert "conflicts with" in msg and "regional_inductor" in msg and "full_inductor_compilation" in msg


def test_conflict_with_a_pass_the_backend_adds():
    msg = refused(["regional_inductor"], backend="full")
    assert "(added by --compile.inductor_compilation full)" in msg
    assert "remove 'regional_inductor' from --compile.passes" in msg


def test_pass_after_the_one_that_must_be_last():
    msg = refused(["cudagraph", "inductor_decomposition"], device="cuda")
    assert "'cudagraph' must be the last pass" in msg and "move 'cudagraph' to the end" in msg


def test_must_be_last_also_behind_a_backend():
    # the regional backend puts regional_inductor in front: cudagraph is still followed by a graph pass
    msg = refused(["cudagraph", "inductor_decomposition"], device="cuda", backend="regional")
    assert "'cudagraph' must be the last pass but 'inductor_decomposition' follows it" in msg


def test_graph_pass_after_a_compiling_pass():
    msg = refused(["regional_inductor", "inductor_decomposition"])
    assert "transforms a graph but comes after 'regional_inductor'" in msg
    assert "put 'inductor_decomposition' before 'regional_inductor'" in msg


@pytest.mark.parametrize("passes", [["regional_inductor"], ["inductor_decomposition", "full_inductor_compilation"]])
def test_any_pass_in_eager_mode(passes):
    msg = refused(passes, mode="eager")
    assert "--compile.mode eager captures no graph" in msg and "--compile.mode aot_fx_trace" in msg


@pytest.mark.parametrize("backend", ["regional", "full"])
def test_inductor_backend_in_eager_mode(backend):
    msg = refused([], mode="eager", backend=backend)
    assert f"(added by --compile.inductor_compilation {backend})" in msg and "--compile.inductor_compilation none" in msg


def test_pass_the_mode_does_not_support():
    msg = refused(["cudagraph"], mode="aot", device="cuda")
    assert "'cudagraph' does not support --compile.mode aot" in msg and "--compile.mode aot_fx_trace" in msg


def test_cuda_only_pass_on_cpu():
    msg = refused(["cudagraph"])
    assert "'cudagraph' needs a CUDA device and this run is on cpu" in msg


@pytest.mark.parametrize("name", ["auto_bucketing", "transformer_block_bucketing"])
def test_bucketing_refused_with_autoparallel_backend(name):
    msg = refused([name], backend="autoparallel_backend")
    assert "it does its own" in msg and f"remove {name!r}" in msg


def test_every_declared_backend_exclusion_is_enforced():
    for spec in PASSES.values():
        for backend in spec.excluded_backends:
            assert "it does its own" in refused([spec.name], backend=backend)


@pytest.mark.parametrize("passes, backend, device", [
    ([], "none", "cpu"),
    ([], "regional", "cpu"),
    ([], "full", "cpu"),
    (["inductor_decomposition"], "full", "cpu"),
    (["full_inductor_compilation"], "full", "cpu"),
    (["inductor_decomposition", "full_inductor_compilation", "cudagraph"], "none", "cuda"),
    (["cudagraph"], "full", "cuda"),
    (["cudagraph"], "regional", "cuda"),
    (["cudagraph", "inductor_decomposition"], "full", "cuda"),
    (["inductor_decomposition"], "regional", "cpu"),
])
def test_valid_combinations_pass(passes, backend, device, monkeypatch):
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "1")
    check_passes(cfg_for(passes, backend=backend), device)


def test_cudagraph_turns_nccl_graph_register_off_unless_set(monkeypatch):
    monkeypatch.delenv("NCCL_GRAPH_REGISTER", raising=False)
    check_passes(cfg_for(["cudagraph"]), "cuda")
    import os

    assert os.environ["NCCL_GRAPH_REGISTER"] == "0"
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "1")
    check_passes(cfg_for(["cudagraph"]), "cuda")
    assert os.environ["NCCL_GRAPH_REGISTER"] == "1"


@pytest.mark.parametrize("backend, user, expected", [
    ("none", ["cudagraph"], ["cudagraph"]),
    ("regional", ["cudagraph"], ["regional_inductor", "cudagraph"]),
    ("full", ["cudagraph"], ["inductor_decomposition", "full_inductor_compilation", "cudagraph"]),
    ("full", ["full_inductor_compilation"], ["inductor_decomposition", "full_inductor_compilation"]),
    ("none", ["cudagraph", "inductor_decomposition"], ["cudagraph", "inductor_decomposition"]),
])
def test_native_backend_pass_lists(backend, user, expected):
    from graph_trainer.backends import get_backend

    assert get_backend(backend).pass_names(user) == expected


@pytest.mark.parametrize("backend, user, expected", [
    ("full", ["separate_gather_group", "transformer_block_bucketing"], ["separate_gather_group", "transformer_block_bucketing"]),
    ("regional", ["transformer_block_bucketing"], ["transformer_block_bucketing"]),
    ("autoparallel_backend", [], ["autoparallel_scheduling"]),
    ("none", ["auto_bucketing", "cudagraph"], ["auto_bucketing"]),
])
def test_graph_passes_stop_at_the_first_that_lowers_or_compiles(backend, user, expected):
    """What the memory policy runs on a copy of its rewrite (`PassContext.later_passes`): the backend's passes
    that hand a graph on, before Inductor's decomposition, a compile, or a pass that wraps the compiled step."""
    assert graph_passes(get_backend(backend).pass_names(user)) == expected


def test_registry_table_lists_every_pass_with_its_constraints():
    table = registry_table().splitlines()
    assert table[0].split() == list(COLUMNS)
    rows = {line.split()[0]: line for line in table[2:]}
    assert set(rows) == set(PASSES)
    full = rows["full_inductor_compilation"].split()
    assert full[1] == "forward,backward,train_step" and full[3] == "inductor_decomposition"
    cudagraph = rows["cudagraph"].split()
    assert cudagraph[2] == "aot_fx_trace" and cudagraph[5:7] == ["yes", "yes"]
    assert rows["regional_inductor"].split()[4] == "full_inductor_compilation"


def test_cli_lists_passes():
    proc = launch(["train", "--compile.list_passes"], timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == registry_table()


@pytest.mark.parametrize("argv, needle", [
    (["--compile.mode", "aot", "--compile.passes", "cudagraph"], "does not support --compile.mode aot"),
    (["--compile.mode", "aot_fx_trace", "--compile.inductor_compilation", "regional", "--compile.passes",
      "inductor_decomposition,full_inductor_compilation"], "conflicts with"),
])
def test_cli_refuses_with_one_line(argv, needle, tmp_path):
    proc = launch(["train", "--job.dump_folder", str(tmp_path / "out"), *argv], timeout=300)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("graph-trainer: error:"), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "out").exists()


def imported_modules(module_name: str) -> set[str]:
    """Every module `module_name` imports, at top level or inside functions, relative ones resolved."""
    module = importlib.import_module(module_name)
    found = set()
    for node in ast.walk(ast.parse(Path(module.__file__).read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), module.__package__)
            # `from package import member` names a module too.
            found |= {base, *(f"{base}.{alias.name}" for alias in node.names)}
    return found


@pytest.mark.parametrize("registry, members", [
    ("graph_trainer.passes.registry", lambda: {spec.fn.__module__ for spec in PASSES.values()}),
    ("graph_trainer.backends.base", lambda: {type(get_backend(name)).__module__ for name in backend_names()}),
], ids=["passes", "backends"])
def test_registries_import_none_of_their_members(registry, members):
    # Each member registers itself and its package imports them all; a registry importing a member
    # would tie the interface to every implementation (and to their import cycles).
    members = members()
    assert len(members) > 1
    assert not imported_modules(registry) & members
