"""`pjinfer serve --config configs/pool.toml`: [[models]] entries become the pool's models,
the config's engine sections their defaults; the serve flags of this feature parse."""

from __future__ import annotations

from pathlib import Path

import pytest

from pjinfer.cli import build_parser, run_config_from_args
from pjinfer.errors import UsageError
from pjinfer.run_config import RunConfigError, load_run_config, parse_run_config
from pjinfer.server.pool_config import build_pool, model_specs
from pjinfer.server_flags import server_args

ROOT = Path(__file__).resolve().parents[2]


def test_example_pool_config():
    config = load_run_config(ROOT / "configs" / "pool.toml")
    demo, lazy = model_specs(config)
    assert demo.name == "pjinfer-demo" and not demo.lazy and demo.memory_share == 0.5
    assert Path(demo.path, "config.json").is_file()  # relative to the config file
    assert lazy.lazy and lazy.idle_unload_s == 600.0
    assert lazy.engine_args["max_num_seqs"] == 8 and demo.engine_args["max_num_seqs"] == 32
    assert lazy.engine_args["max_num_batched_tokens"] == 512
    pool = build_pool(config)
    assert [c["state"] for c in pool.cards(0)] == ["unloaded", "unloaded"]  # loads at start-up


@pytest.mark.parametrize("models, words", [
    ([{"path": "x"}], "needs name"),
    ([{"name": "a", "colour": "red"}], "unknown key 'colour'"),
    ([{"name": "a", "lazy": "yes"}], "lazy must be true or false"),
    ([{"name": "a", "max_num_seqs": 1.5}], "max_num_seqs must be an integer"),
    ({"name": "a"}, "array of tables"),
])
def test_bad_model_entries_name_the_problem(models, words):
    with pytest.raises(RunConfigError, match=words):
        parse_run_config({"models": models}, source="pool.toml")


def test_bad_spec_values_are_errors():
    config = parse_run_config({"models": [{"name": "a", "memory_share": 1.5}]})
    with pytest.raises(ValueError, match=r"memory_share of 'a' must be in \(0, 1\]"):
        model_specs(config)
    config = parse_run_config({"models": [{"name": "a", "block_size": 3}]})
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        model_specs(config)


def test_serve_flags():
    args = build_parser().parse_args(["serve", "--data-parallel-size", "2",
                                      "--admin-api-key", "k", "--tensor-parallel-size", "2"])
    config = run_config_from_args(args)
    assert config.parallel.data_parallel_size == 2
    assert server_args(config)["admin_api_key"] == "k"
    empty = run_config_from_args(build_parser().parse_args(["serve", "--admin-api-key", ""]))
    with pytest.raises(UsageError, match="--admin-api-key must be a non-empty string"):
        server_args(empty)


def test_repository_versions_and_references(tmp_path):
    from pjinfer.server.model_repository import ModelRef, ModelRepository

    for version in ("2", "10", "9", "beta"):
        (tmp_path / "m" / version).mkdir(parents=True)
    repo = ModelRepository(tmp_path)
    assert repo.versions("m") == ["2", "9", "10", "beta"]  # numbers as numbers, tags last
    assert repo.resolve("m@9") == ("9", tmp_path / "m" / "9")
    assert repo.resolve(ModelRef("m", "beta"))[0] == "beta"
    with pytest.raises(ValueError, match="no version '3'.*versions: 2, 9, 10, beta"):
        repo.resolve("m@3")
    with pytest.raises(ValueError, match="not in the repository"):
        repo.resolve("other")
    with pytest.raises(ValueError, match="'name' or 'name@version'"):
        ModelRef.parse("@1")
