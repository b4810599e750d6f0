"""Config loading: TOML, CLI overrides, unknown keys, the shipped configs, round trip."""

from pathlib import Path

import pytest

from graph_trainer.config import ConfigError, JobConfig, load_toml, parse_args, to_toml

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_default_is_llama3_debug():
    cfg = parse_args([])
    assert (cfg.model.name, cfg.model.flavor) == ("llama3", "debugmodel")


def test_cli_overrides_toml(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[training]\nsteps = 7\nseq_len = 64\n[compile]\npasses = ["a", "b"]\n')
    cfg = parse_args(["--config", str(f), "--training.steps", "20", "--compile.dump_graphs"])
    assert cfg.training.steps == 20 and cfg.training.seq_len == 64
    assert cfg.compile.passes == ["a", "b"] and cfg.compile.dump_graphs is True
    cfg = parse_args(["--config", str(f), "--compile.passes", "x,y", "--compile.no-dump_graphs"])
    assert cfg.compile.passes == ["x", "y"] and cfg.compile.dump_graphs is False


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--training.stepz", "3"], "did you mean '--training.steps'"),
        (["--trainig.steps", "3"], "unknown flag"),
        (["--training.steps", "three"], "training.steps must be an integer"),
        (["--compile.mode", "fast"], "compile.mode must be one of eager, jit, aot, aot_fx_trace"),
        (["steps"], "flags look like --training.steps 20"),
        (["--training.steps"], "needs a value"),
    ],
)
def test_bad_flags_are_one_line_errors(argv, fragment):
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_unknown_toml_key_lists_valid_keys(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[training]\nstep = 3\n")
    with pytest.raises(ConfigError) as e:
        load_toml(f)
    assert "unknown key training.step" in str(e.value) and "valid keys of [training]: steps" in str(e.value)
    f.write_text("[trainin]\nsteps = 3\n")
    with pytest.raises(ConfigError, match="did you mean 'training'"):
        load_toml(f)


@pytest.mark.parametrize("name", ["llama3_debug", "llama3_1b", "llama3_8b", "llama3_70b",
                                  "deepseek_v3_debug", "deepseek_v3_16b", "deepseek_v3_671b"])
def test_shipped_configs_load_and_name_real_flavors(name):
    from graph_trainer import models

    cfg = load_toml(CONFIGS / f"{name}.toml")
    assert cfg.model.flavor in models.get_spec(cfg.model.name).flavors


def test_to_toml_round_trips(tmp_path):
    cfg = parse_args(["--training.steps", "3", "--compile.passes", "a,b", "--job.description", 'say "hi"'])
    f = tmp_path / "out.toml"
    f.write_text(to_toml(cfg))
    assert load_toml(f, JobConfig()) == cfg
