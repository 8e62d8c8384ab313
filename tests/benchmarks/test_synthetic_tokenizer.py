"""Config-only model folders get a tokenizer whose ids cover the whole model vocabulary."""

from __future__ import annotations

from pjinfer.benchmarks.synthetic_tokenizer import has_tokenizer, synthetic_tokenizer_dir
from pjinfer.tokenizer import load_tokenizer


def test_synthetic_tokenizer_round_trips_every_id(tmp_path):
    folder = synthetic_tokenizer_dir(1000, root=tmp_path)
    assert has_tokenizer(folder) and not has_tokenizer(tmp_path)
    tok = load_tokenizer(folder)
    assert len(tok) == 1000
    assert tok.decode([1, 999, 42]) == "<1> <999> <42>"
    assert tok.encode("<7> <998>") == [7, 998]
    assert synthetic_tokenizer_dir(1000, root=tmp_path) == folder  # built once, reused
