"""The `pjinfer` command as a user runs it (subprocesses; the demo model for generate)."""

from __future__ import annotations

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
    for command in ("serve", "generate", "bench", "convert"):
        assert command in r.stdout
    serve = pjinfer_cli("serve", "--help")
    for flag in ("--max-model-len", "--api-key", "--no-enable-chunked-prefill", "--config"):
        assert flag in serve.stdout


@pytest.mark.parametrize(("args", "words"), [
    (["serve", "--port", "x"], "--port"),
    (["serve", "--bogus"], "--bogus"),
    (["serve", "--block-size", "3"], "--block-size"),
    (["serve", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["serve", "/nonexistent/model"], "not a local folder"),
    (["serve", "--config", "/nonexistent.toml"], "does not exist"),
    (["generate", "hi", "--temperature", "-1"], "--temperature"),
])
def test_bad_flags_exit_2_with_one_line(args, words):
    r = pjinfer_cli(*args)
    assert r.returncode == 2
    assert words in r.stderr
    assert "Traceback" not in r.stderr


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
