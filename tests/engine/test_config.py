"""The engine-argument table: every field documented and placed; choices checked on entry."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from pjinfer.engine.config import (
    ENGINE_ARGS,
    INT_LIST,
    LOAD_FORMATS,
    SECTIONS,
    EngineConfig,
    arg,
)


def test_every_field_is_a_documented_row():
    assert list(ENGINE_ARGS) == [f.name for f in dataclasses.fields(EngineConfig)]
    for a in ENGINE_ARGS.values():
        assert a.help and a.section in SECTIONS
        assert a.type in (str, int, float, bool, INT_LIST)
        assert a.flag == "--" + a.name.replace("_", "-")


@pytest.mark.parametrize("name", [n for n, a in ENGINE_ARGS.items() if a.choices])
def test_choices_are_checked(name):
    valid = ", ".join(ENGINE_ARGS[name].choices)
    with pytest.raises(ValueError, match=f"{name} must be one of {valid}, got 'bogus'"):
        EngineConfig(**{name: "bogus"})


def test_defaults_are_valid_choices():
    for a in ENGINE_ARGS.values():  # None: unset (quantization: the checkpoint's)
        assert a.choices is None or a.default is None or a.default in a.choices


def test_a_row_needs_a_known_section():
    with pytest.raises(ValueError, match="section must be one of"):
        arg(0, "help", "schedular")


def test_load_formats_agree_with_the_loader():
    """Until pjinfer.weights imports LOAD_FORMATS from here, the two must stay equal."""
    from pjinfer import weights

    assert weights.LOAD_FORMATS == LOAD_FORMATS


def test_the_table_imports_without_jax():
    """`pjinfer --help` builds its flags from the table; that must not start JAX."""
    code = "import sys, pjinfer.engine.config; assert 'jax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("sizes", [[], [0, 8], [2, -1], 8, "2 8", [2.0], [True]])
def test_cuda_graph_sizes_must_be_positive_integers(sizes):
    with pytest.raises(ValueError, match="cuda_graph_sizes must be a non-empty list of positive "
                                         "integers"):
        EngineConfig(cuda_graph_sizes=sizes)


def test_cuda_graph_sizes_are_kept_sorted_and_distinct():
    assert EngineConfig(cuda_graph_sizes=[32, 2, 8, 2]).cuda_graph_sizes == (2, 8, 32)
