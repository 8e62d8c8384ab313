"""TOML run configs: parsing, command-line overrides, and errors that name file/section/key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pjinfer.cli import build_parser, engine_config, run_config_from_args
from pjinfer.engine.config import ENGINE_ARGS, EngineConfig
from pjinfer.run_config import RunConfigError, load_run_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SHIPPED = {"llama3-8b-h200.toml": "llama3-8b", "llama3-70b-tp2-h200.toml": "llama3-70b",
           "qwen2.5-7b.toml": "qwen2.5-7b", "mistral-7b.toml": "mistral-7b"}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_sections_map_to_engine_and_server_args(tmp_path):
    config = load_run_config(write(tmp_path, """
[model]
dtype = "bfloat16"
max_model_len = 256
[cache]
block_size = 32
enable_prefix_caching = true
[scheduler]
max_num_seqs = 8
request_timeout = 30
[parallel]
tensor_parallel_size = 2
data_parallel_size = 2
[server]
port = 9000
api_key = "k"
allowed_origins = ["https://ui.example"]
max_request_bytes = 1024
"""))
    assert config.engine_args() == {"dtype": "bfloat16", "max_model_len": 256, "block_size": 32,
                                    "enable_prefix_caching": True, "max_num_seqs": 8,
                                    "request_timeout": 30, "tensor_parallel_size": 2}
    assert config.server_args()["port"] == 9000 and config.server_args()["api_key"] == "k"
    assert config.server_args()["host"] == "127.0.0.1"  # default kept
    assert config.server_args()["allowed_origins"] == ["https://ui.example"]
    assert config.server_args()["max_request_bytes"] == 1024
    assert config.parallel.world_size == 4


def test_flags_override_the_file(tmp_path):
    path = write(tmp_path, "[cache]\nblock_size = 32\n[server]\nport = 9000\n")
    args = build_parser().parse_args(["serve", "--config", str(path), "--block-size", "64",
                                      "--no-enable-chunked-prefill"])
    config = run_config_from_args(args)
    assert config.engine_args() == {"block_size": 64, "enable_chunked_prefill": False}
    assert config.server_args()["port"] == 9000


@pytest.mark.parametrize(("text", "words"), [
    ("[modle]\npath = 'x'\n", ["unknown section [modle]", "[model]"]),
    ("[cache]\nblok_size = 16\n", ["unknown key 'blok_size' in [cache]", "block_size"]),
    ("[cache]\nblock_size = '16'\n", ["[cache] block_size must be an integer"]),
    ("[cache]\nenable_prefix_caching = 1\n", ["enable_prefix_caching must be true or false"]),
    ("[scheduler]\nmax_num_seqs = 1.5\n", ["max_num_seqs must be an integer"]),
    ("[compilation]\ncuda_graph_sizes = 8\n", ["cuda_graph_sizes must be an array of integers"]),
    ("[compilation]\ncuda_graph_sizes = [2, '8']\n", ["an array of integers, got list"]),
    ("[parallel]\nnum_processes = 2\n", ["coordinator_address"]),
    ("cache = 3\n", ["must be a [cache] table"]),
    ("[cache\n", ["not valid TOML"]),
])
def test_errors_name_file_section_and_key(tmp_path, text, words):
    with pytest.raises(RunConfigError) as e:
        load_run_config(write(tmp_path, text))
    assert str(tmp_path / "run.toml") in str(e.value)
    for w in words:
        assert w in str(e.value)


def test_missing_file():
    with pytest.raises(RunConfigError, match="does not exist"):
        load_run_config("/nonexistent/run.toml")


def test_engine_value_errors_name_the_flag_and_key(tmp_path):
    path = write(tmp_path, "[cache]\nblock_size = 24\n")
    config = run_config_from_args(build_parser().parse_args(["serve", "--config", str(path)]))
    with pytest.raises(Exception, match=r"--block-size \(\[cache\] block_size in .*power of two"):
        engine_config(config)


def test_demo_config_builds_an_engine_config():
    config = load_run_config(CONFIGS / "demo-cpu.toml")
    ecfg = EngineConfig.from_kwargs(**config.engine_args())
    assert ecfg.model is None and ecfg.num_kv_blocks == 1024


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_configs_work_with_dummy_weights(name):
    """Each shipped config, pointed at its public config.json, is a valid engine config."""
    config = load_run_config(CONFIGS / name).with_overrides(
        "model", {"path": str(CONFIGS / "models" / SHIPPED[name]), "load_format": "dummy"})
    ecfg = EngineConfig.from_kwargs(**config.engine_args())
    assert ecfg.dtype == "bfloat16" and ecfg.load_format == "dummy"
    assert (Path(ecfg.model) / "config.json").is_file()


def test_relative_model_path_is_relative_to_the_file(tmp_path):
    (tmp_path / "models" / "m").mkdir(parents=True)
    config = load_run_config(write(tmp_path, "[model]\npath = 'models/m'\n"))
    assert config.engine_args()["model"] == str(tmp_path / "models" / "m")


@pytest.mark.parametrize("name", ENGINE_ARGS)
def test_every_engine_argument_has_a_toml_key(tmp_path, name, engine_arg_values):
    arg, value = ENGINE_ARGS[name], engine_arg_values[name]
    config = load_run_config(write(tmp_path, f"[{arg.section}]\n{arg.key} = {json.dumps(value)}\n"))
    assert EngineConfig.from_kwargs(**config.engine_args()) == EngineConfig(**{name: value})
