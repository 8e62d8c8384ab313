"""The `pjinfer` command as a user runs it (subprocesses; the demo model for generate)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import pjinfer


def pjinfer_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pjinfer.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_version():
    r = pjinfer_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"pjinfer {pjinfer.__version__}"


def test_help_lists_commands():
    r = pjinfer_cli("--help")
    assert r.returncode == 0
    for command in ("serve", "generate", "demo-path", "bench", "convert"):
        assert command in r.stdout
    serve = pjinfer_cli("serve", "--help")
    for flag in ("--max-model-len", "--api-key", "--no-enable-chunked-prefill", "--config",
                 "--max-request-bytes", "--engine-stuck-timeout", "--allowed-origins",
                 "--ssl-keyfile", "--ssl-certfile", "--enable-auto-tool-choice",
                 "--tool-call-parser"):
        assert flag in serve.stdout


@pytest.mark.parametrize(("args", "words"), [
    (["serve", "--port", "x"], "--port"),
    (["serve", "--bogus"], "--bogus"),
    (["serve", "--block-size", "3"], "--block-size"),
    (["serve", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["serve", "/nonexistent/model"], "not a local folder"),
    (["serve", "--config", "/nonexistent.toml"], "does not exist"),
    (["serve", "--ssl-keyfile", "key.pem"], "--ssl-keyfile and --ssl-certfile"),
    (["serve", "--allowed-origins", '{"a": 1}'], "--allowed-origins"),
    (["serve", "--max-request-bytes", "0"], "--max-request-bytes"),
    (["serve", "--enable-auto-tool-choice"], "--enable-auto-tool-choice needs "
                                             "--tool-call-parser"),
    (["serve", "--tool-call-parser", "pythonic"], "--tool-call-parser must be one of"),
    (["serve", "--chat-template", "/nonexistent.jinja"], "neither a readable file nor a Jinja"),
    (["serve", "--chat-template", "{% for m in messages %}"], "--chat-template does not compile"),
    (["generate", "hi", "--temperature", "-1"], "--temperature"),
])
def test_bad_flags_exit_2_with_one_line(args, words):
    r = pjinfer_cli(*args)
    assert r.returncode == 2
    assert words in r.stderr
    assert "Traceback" not in r.stderr


def test_demo_path_is_a_folder_transformers_loads_the_tokenizer_from():
    from transformers import AutoTokenizer

    r = pjinfer_cli("demo-path")
    assert r.returncode == 0 and r.stderr == ""
    tokenizer = AutoTokenizer.from_pretrained(r.stdout.strip())
    assert tokenizer.decode(tokenizer.encode("Beautiful is better than ugly.",
                                             add_special_tokens=False)) == \
        "Beautiful is better than ugly."


def test_generate_on_the_demo_model():
    r = pjinfer_cli("generate", "Beautiful is better than", "--temperature", "0",
                    "--max-tokens", "3")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(" ugly.")


def test_generate_chat_n2():
    r = pjinfer_cli("generate", "What is the Zen of Python?", "--chat", "--temperature", "0",
                    "--max-tokens", "6", "--n", "2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("The Zen of Python") == 2
    assert "--- completion 1 (length) ---" in r.stdout


def test_serve_hands_the_server_flags_to_the_server(monkeypatch, tmp_path):
    """In process, with the engine and uvicorn replaced: the flags reach serve() (a
    --chat-template file as its text)."""
    template = tmp_path / "chat.jinja"  # transformers' own tags (loop controls, generation)
    template.write_text("{% for m in messages %}{% generation %}{{ m['content'] }}"
                        "{% endgeneration %}{% if loop.index > 2 %}{% break %}{% endif %}"
                        "{% endfor %}")
    from pjinfer import cli
    from pjinfer.server.app import ServerOptions

    seen = {}
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    monkeypatch.setattr("pjinfer.engine.async_engine.AsyncEngine", lambda config: "engine")
    monkeypatch.setattr("pjinfer.server.serve.serve",
                        lambda engine, options, **kw: seen.update(options=options, **kw))
    assert cli.main(["serve", "--allowed-origins", '["*"]', "--max-request-bytes", "100",
                     "--engine-stuck-timeout", "5", "--ssl-keyfile", "k.pem",
                     "--ssl-certfile", "c.pem", "--api-key", "s", "--port", "8123",
                     "--enable-auto-tool-choice", "--tool-call-parser", "mistral",
                     "--chat-template", str(template), "--trust-request-chat-template"]) == 0
    assert seen["options"] == ServerOptions(api_keys=("s",), max_request_bytes=100,
                                            engine_stuck_timeout=5.0, allowed_origins=("*",),
                                            enable_auto_tool_choice=True,
                                            tool_call_parser="mistral",
                                            chat_template=template.read_text(),
                                            trust_request_chat_template=True)
    assert (seen["ssl_keyfile"], seen["ssl_certfile"], seen["port"]) == ("k.pem", "c.pem", 8123)


@pytest.mark.parametrize(("flags", "env", "folder"), [
    ([], {"XDG_CACHE_HOME": "/xdg"}, "/xdg/pjinfer"),
    ([], {"HOME": "/home/u"}, "/home/u/.cache/pjinfer"),
    ([], {"PJINFER_COMPILATION_CACHE_DIR": "/env"}, "/env"),
    ([], {"PJINFER_COMPILATION_CACHE_DIR": ""}, None),  # off
    (["--compilation-cache-dir", "/flag"], {"PJINFER_COMPILATION_CACHE_DIR": "/env"}, "/flag"),
    (["--compilation-cache-dir", ""], {"XDG_CACHE_HOME": "/xdg"}, ""),  # off
])
def test_serve_and_generate_keep_compiled_steps_in_the_user_cache(monkeypatch, flags, env,
                                                                  folder):
    from pjinfer.cli import build_parser, engine_config, run_config_from_args, with_default_cache

    for name in ("PJINFER_COMPILATION_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for argv in (["serve", *flags], ["generate", "hi", *flags]):
        config = with_default_cache(run_config_from_args(build_parser().parse_args(argv)))
        assert engine_config(config).compilation_cache_dir == folder


def test_no_pytorch_warning_on_the_cli_path(tmp_path):
    """Where torch is absent (the serve path needs none), transformers announces it at import;
    the CLI silences that line. torch is hidden here with a None entry in sys.modules."""
    hide_torch = "import sys; sys.modules['torch'] = None; "
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    plain = subprocess.run([sys.executable, "-c", hide_torch + "import transformers"],
                           capture_output=True, text=True, env=env, timeout=120)
    assert "PyTorch was not found" in plain.stderr  # the simulation shows the warning
    cli = subprocess.run(
        [sys.executable, "-c", hide_torch + "from pjinfer.cli import main; "
         "main(['generate', 'Beautiful is better than', '--temperature', '0', '--max-tokens',"
         " '2', '--compilation-cache-dir', ''])"],
        capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert "ugly" in cli.stdout and "PyTorch was not found" not in cli.stderr
