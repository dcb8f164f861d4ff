"""training/cli.py: the command line generated from the configuration tree (one flag per field, of the same name),
--size and --config (a recipe or a file), --resume from a run's config.json, and errors as one line with exit status 2."""

from __future__ import annotations

import json
import re
from dataclasses import fields

import pytest

import train
from model import PRESETS, ModelConfig
from training import cli, recipes
from training.config import SECTIONS, Config, ConfigError, flag_of, resolve

TINY = ["--d-model", "64", "--n-layers", "2", "--n-heads", "4", "--context-length", "32"]


def one_line_error(capsys, argv: list[str]) -> str:
    """train.py's error for `argv`: exit status 2 and one line on stderr, without argparse's usage."""
    with pytest.raises(SystemExit) as exit:
        train.main(argv)
    assert exit.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured.err
    assert "usage" not in captured.err
    return captured.err.strip()


# ------------------------------------------------------------------------------------------------ flags


def test_flags_map_one_to_one_onto_fields():
    config, explicit = cli.parse(["--lr", "1e-3", "--log-every", "5", "--keep-checkpoints", "0", "--no-compile",
                                  "--cuda-graph", "--min-lr", "1e-5", "--eval-batches", "3", "--wandb", "disabled",
                                  "--window", "16", "--window-pattern", "LG", "--grad-accum-steps", "2"])
    assert (config.optim.lr, config.optim.min_lr) == (1e-3, 1e-5)
    assert (config.run.log_every, config.run.keep_checkpoints, config.run.eval_batches) == (5, 0, 3)
    assert (config.execution.compile, config.execution.cuda_graph, config.execution.grad_accum_steps) == \
        (False, True, 2)
    assert config.run.wandb == "disabled"
    assert (config.model.window, config.model.window_pattern) == (16, "LG")
    assert explicit == {"lr", "log_every", "keep_checkpoints", "compile", "cuda_graph", "min_lr", "eval_batches",
                        "wandb", "window", "window_pattern", "grad_accum_steps"}
    untouched = Config()
    assert config.data == untouched.data and config.run.steps == untouched.run.steps
    assert cli.parse([]) == (Config(), frozenset())


def test_every_field_has_its_flag_named_as_the_field():
    options = cli.build_parser("train.py", "")._option_string_actions
    for section, cls in SECTIONS.items():
        for f in fields(cls):
            flag = flag_of(section, f.name)
            if (section, f.name) in cli.DERIVED:  # the model's vocabulary comes from the data: --vocab-size is its
                assert options[flag].dest != f"{section}.{f.name}"
                continue
            assert flag == "--" + f.name.replace("_", "-") and flag in options, (section, f.name)
            assert options[flag].dest == f"{section}.{f.name}"


@pytest.mark.parametrize("retired", [["--overlap-optimizer"], ["--no-checkpoint"], ["--optim-state-dtype", "bf16"],
                                     ["--weight-grads", "fp32"], ["--residual", "fp32"], ["--fused-rope"],
                                     ["--fused-gate-up"], ["--compile-scope", "blocks"]])
def test_retired_flags_are_refused_in_one_line(capsys, retired):
    assert one_line_error(capsys, retired) == f"error: unrecognized arguments: {' '.join(retired)}"


def test_bad_values_are_one_line_errors(capsys):
    assert one_line_error(capsys, ["--lr", "abc"]) == "error: argument --lr: invalid float value: 'abc'"
    assert one_line_error(capsys, ["--dtype", "fp64"]).startswith("error: argument --dtype: invalid choice: 'fp64'")
    assert one_line_error(capsys, ["--device", "cpu", "--lr", "1e-4", "--min-lr", "1e-3"]) == \
        "error: --min-lr (0.001) is larger than --lr (0.0001)"
    assert one_line_error(capsys, ["--mlp", "gelu"]).startswith("error: argument --mlp: invalid choice: 'gelu'")


def test_a_config_file_with_an_unknown_mlp_names_it(capsys, tmp_path):
    (tmp_path / "c.json").write_text('{"model": {"mlp": "gelu"}}')
    assert one_line_error(capsys, ["--config", str(tmp_path / "c.json")]) == \
        "error: --mlp must be one of swiglu, relu2, got 'gelu'"


def test_size_fills_the_preset_and_explicit_shape_flags_win():
    d_model, d_ff, n_layers, n_heads = PRESETS["tiny"]
    config, _ = cli.parse(["--size", "tiny"])
    m = config.model
    assert (m.d_model, m.d_ff, m.n_layers, m.n_heads) == (d_model, d_ff, n_layers, n_heads)
    config, _ = cli.parse(["--size", "tiny", "--d-model", "128", "--n-heads", "2"])
    m = config.model
    assert (m.d_model, m.d_ff, m.n_layers, m.n_heads) == (128, d_ff, n_layers, 2)
    assert cli.parse(["--size", "small"])[0].model == Config().model  # the default model is the small preset


def test_help_lists_at_most_30_options_and_hides_the_rest(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    with pytest.raises(SystemExit) as exit:
        train.main(["--help"])
    assert exit.value.code == 0
    text = capsys.readouterr().out
    options = [line for line in text.splitlines() if re.match(r"^  -", line)]
    assert options[0].lstrip().startswith("-h, --help")
    assert 10 <= len(options) <= 30, options
    for main in ("--attn", "--dtype", "--lr", "--steps", "--out", "--resume", "--data", "--config", "--size"):
        assert any(line.lstrip().startswith(main) for line in options), main
    for hidden in ("--log-every", "--min-lr", "--keep-checkpoints", "--window-pattern", "--dist-timeout"):
        assert f"[{hidden} " not in text  # not in the usage (the epilog names some as examples)
        assert not any(line.lstrip().startswith(hidden) for line in options)
    assert cli.parse(["--dist-timeout", "60"])[0].execution.dist_timeout == 60.0  # hidden, still accepted


# ------------------------------------------------------------------------------------------------ --config


def test_a_config_file_may_hold_some_sections_and_the_flags_win(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"optim": {"lr": 1e-3}, "run": {"steps": 20, "log_every": 2},
                                "model": {"d_model": 64, "n_heads": 4}}))
    config, explicit = cli.parse(["--config", str(path)])
    assert (config.optim.lr, config.run.steps, config.run.log_every) == (1e-3, 20, 2)
    assert (config.model.d_model, config.model.n_heads, config.model.n_layers) == (64, 4, Config().model.n_layers)
    assert config.optim.min_lr == Config().optim.min_lr and config.execution == Config().execution
    assert {"lr", "steps", "log_every", "d_model", "n_heads"} <= explicit
    config, _ = cli.parse(["--config", str(path), "--steps", "30"])
    assert (config.run.steps, config.optim.lr) == (30, 1e-3)


def test_a_runs_config_json_starts_the_same_configuration(tmp_path):
    config, _ = cli.parse([*TINY, "--device", "cpu", "--lr", "2e-4", "--steps", "40", "--out", str(tmp_path)])
    config = resolve(config).config.replace(model={"vocab_size": 256})  # as the Trainer writes it
    cli.write_config(config, tmp_path)
    assert cli.parse(["--config", str(tmp_path / cli.CONFIG_FILE)])[0] == config


@pytest.mark.parametrize("content, message", [
    ({"optimizer": {"lr": 1e-3}}, "'optimizer' is not a section (model, execution, optim, data, run)"),
    ({"optim": {"betas": [0.9, 0.95]}}, "unknown field optim.betas"),
    ({"model": {"attn": "flash"}}, "unknown field model.attn"),  # a retired ModelConfig field
    ({"run": 3}, "'run' is not a section"),
    ([1, 2], "must hold an object of sections"),
])
def test_a_config_file_with_an_unknown_name_is_refused_naming_the_file_and_key(capsys, tmp_path, content, message):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ConfigError) as e:
        cli.parse(["--config", str(path)])
    assert str(e.value).startswith(f"--config {path}") and message in str(e.value)
    assert one_line_error(capsys, ["--config", str(path)]) == f"error: {e.value}"


def test_a_config_file_that_is_missing_or_not_json_is_refused(tmp_path):
    names = re.escape(", ".join(recipes.RECIPES))
    with pytest.raises(ConfigError, match=rf"^--config {tmp_path}/none.json does not exist \(nor is it a recipe: "
                                          rf"{names}\)$"):
        cli.parse(["--config", str(tmp_path / "none.json")])
    (tmp_path / "bad.json").write_text("{optim: 1}")
    with pytest.raises(ConfigError, match=rf"^--config {tmp_path}/bad.json is not a JSON file: "):
        cli.parse(["--config", str(tmp_path / "bad.json")])


def test_a_recipe_is_a_config_by_name_and_the_flags_still_win():
    config, explicit = cli.parse(["--config", "muon"])
    assert (config.optim.optimizer, config.optim.lr) == ("muon", recipes.MUON_LR)
    assert config.replace(optim={"optimizer": "adamw", "lr": Config().optim.lr}) == Config()  # nothing else
    assert {"optimizer", "lr"} <= explicit
    config, _ = cli.parse(["--config", "muon", "--lr", "1e-3"])
    assert (config.optim.optimizer, config.optim.lr) == ("muon", 1e-3)
    assert cli.parse(["--config", "adamw"])[0] == Config()


def test_every_recipe_resolves_and_is_listed_in_the_help(capsys):
    for name in recipes.recipe_names():
        sections = cli.read_config(name)
        assert sections == recipes.RECIPES[name].sections
        resolve(cli.apply(Config(), cli.flatten(sections)).replace(execution={"device": "cpu"}))
    with pytest.raises(SystemExit):
        cli.build_parser("train.py", "").parse_args(["--help"])
    text = capsys.readouterr().out
    assert "Recipes (--config NAME; the flags given still win):" in text
    for recipe in recipes.RECIPES.values():
        assert f"  {recipe.name}" in text and recipe.description[:40] in " ".join(text.split())


# ------------------------------------------------------------------------------------------------ --resume


@pytest.fixture
def run_dir(tmp_path):
    """A run's directory holding the config.json it was started with (--overwrite among its flags)."""
    out = tmp_path / "run"
    config, _ = cli.parse([*TINY, "--device", "cpu", "--lr", "2e-4", "--steps", "40", "--overwrite", "--out",
                           str(out), "--log-every", "3"])
    config = resolve(config).config.replace(model={"vocab_size": 256})
    out.mkdir()
    cli.write_config(config, out)
    return out, config


def test_resume_starts_from_the_runs_config_and_takes_flags_that_keep_the_model(run_dir):
    out, saved = run_dir
    config, explicit = cli.parse(["--resume", "--out", str(out), "--steps", "80", "--lr", "1e-4"])
    assert config.model == saved.model and config.model.vocab_size == 256
    assert config.execution == saved.execution and config.run.log_every == 3
    assert (config.run.steps, config.optim.lr, config.optim.min_lr) == (80, 1e-4, saved.optim.min_lr)
    assert (config.run.resume, config.run.overwrite) == (True, False)  # the saved --overwrite does not come back
    assert explicit == {"resume", "out", "steps", "lr"}
    resolve(config)  # a configuration that runs
    same, _ = cli.parse(["--resume", "--out", str(out), *TINY])  # the run's own shape flags are not a change
    assert same.model == saved.model


@pytest.mark.parametrize("argv, flag, asked, had", [
    (["--d-model", "128"], "--d-model", "128", "64"),
    (["--context-length", "64"], "--context-length", "64", "32"),
    (["--n-kv-heads", "2"], "--n-kv-heads", "2", "None"),
    (["--size", "tiny"], "--d-model", "256", "64"),
])
def test_resume_refuses_a_flag_that_changes_the_model_naming_it_and_both_values(capsys, run_dir, argv, flag, asked,
                                                                                had):
    out, _ = run_dir
    message = one_line_error(capsys, ["--resume", "--out", str(out), *argv])
    assert message.startswith(f"error: {flag} {asked} differs from the run in {out}, which has {had}: a resumed run "
                              "keeps its model")


def test_resume_without_a_saved_config_takes_the_flags(tmp_path):
    config, explicit = cli.parse(["--resume", "--out", str(tmp_path), *TINY])
    assert config.run.resume and config.model == ModelConfig(d_model=64, n_layers=2, n_heads=4, context_length=32,
                                                             d_ff=Config().model.d_ff)
    assert {"resume", "out", "d_model"} <= explicit
