"""Engine flags generated from the EngineConfig table: one per argument, round-trip, documented."""

from __future__ import annotations

import pytest

from pjinfer.cli import build_parser, engine_config, run_config_from_args
from pjinfer.engine.config import ENGINE_ARGS, INT_LIST, EngineArg, EngineConfig
from pjinfer.engine_flags import given_engine_args

COMMANDS = {"serve": ["serve"], "generate": ["generate", "a prompt"]}


def _argv(arg: EngineArg, value: object) -> list[str]:
    if arg.type is bool:
        return [arg.flag if value else "--no-" + arg.flag.removeprefix("--")]
    if arg.type == INT_LIST:
        return [arg.flag, *map(str, value)]
    return [arg.flag, str(value)]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("name", ENGINE_ARGS)
def test_every_engine_argument_has_a_flag_that_round_trips(command, name, engine_arg_values):
    value = engine_arg_values[name]
    args = build_parser().parse_args([*COMMANDS[command], *_argv(ENGINE_ARGS[name], value)])
    assert engine_config(run_config_from_args(args)) == EngineConfig(**{name: value})


def test_serve_takes_the_model_as_argument_or_flag(tmp_path):
    for argv in (["serve", str(tmp_path)], ["serve", "--model", str(tmp_path)]):
        args = build_parser().parse_args(argv)
        assert engine_config(run_config_from_args(args)).model == str(tmp_path)


def test_flags_not_given_are_left_out():
    args = build_parser().parse_args(["serve", "--block-size", "32", "--no-warmup"])
    assert given_engine_args(args) == {"block_size": 32, "warmup": False}


def test_a_bad_choice_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--load-format", "pt"])
    assert "--load-format: invalid choice: 'pt'" in capsys.readouterr().err


def test_serve_help_shows_every_flag_with_its_help(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # no line wrapping inside a help text
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for arg in ENGINE_ARGS.values():
        assert f"{arg.flag} " in text and arg.help in text
    assert "--no-async-scheduling" in text and "(default: 2048)" in text
