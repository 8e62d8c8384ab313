"""The structured-output benchmark's pieces: a BPE stand-in tokenizer that spells JSON with a
real model's vocabulary layout, and a schema whose outputs never end before max_tokens."""

from __future__ import annotations

import json

from pjinfer.benchmarks.bpe_tokenizer import NUM_SPECIAL, bpe_tokenizer_dir
from pjinfer.benchmarks.structured import W4_SCHEMA
from pjinfer.structured_output.grammar import GrammarCompiler
from pjinfer.structured_output.params import StructuredOutputsParams
from pjinfer.tokenizer import load_tokenizer

VOCAB = 20_000  # Llama 3's is 128256 (its build takes a second; the layout is the same)


def test_bpe_stand_in_spells_json_and_keeps_llama3s_special_ids(tmp_path):
    folder = bpe_tokenizer_dir(VOCAB, root=tmp_path)
    assert bpe_tokenizer_dir(VOCAB, root=tmp_path) == folder  # built once, reused
    tok = load_tokenizer(folder)
    assert len(tok) == VOCAB
    first_special = VOCAB - NUM_SPECIAL
    assert (tok.bos_token_id, tok.eos_token_id) == (first_special, first_special + 9)
    text = json.dumps({"title": "Zen", "tags": ["é", "a b"], "score": 7})
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and len(ids) < len(text)  # multi-character tokens


def test_w4_schema_compiles_and_outlasts_any_w4_output(tmp_path):
    tok = load_tokenizer(bpe_tokenizer_dir(VOCAB, root=tmp_path))
    spec = StructuredOutputsParams(json=W4_SCHEMA)
    matcher = GrammarCompiler(tok, VOCAB, [tok.eos_token_id]).compile(spec).matcher()[1]
    prefix = '{"title":"a","tags":[],"score":3,"body":"' + "x" * 6000
    for token in tok.encode(prefix, add_special_tokens=False):
        assert matcher.consume_token(token)
    # 2,048 tokens (W4's longest output) of at most 3 characters cannot close the body
    assert not matcher.is_stopped() and not matcher.is_accepting()


def test_mask_fill_benchmark_times_every_case(tmp_path):
    from pjinfer.benchmarks import mask_fill

    out = tmp_path / "mask_fill.json"
    assert mask_fill.main(["--rows", "4", "--steps", "2", "--vocab-size", "2048",
                           "--cases", "1:1,2:2", "--out", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert set(cases) == {"templates1_threads1", "templates2_threads2"}
    assert all(c["mean_ms"] > 0 and c["total_ms"] >= c["mean_ms"] for c in cases.values())
