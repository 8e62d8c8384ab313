"""Compiling constraints into llguidance matchers, off the engine loop and once per spec.

Building a matcher for a large JSON schema can take a good part of a second (llguidance
drops the GIL meanwhile), which the engine loop must not wait for: compiles run in a small
thread pool, and their results are cached by the constraint's `key`. A request gets a
`deep_copy` of a cached pristine matcher: cheap, the compiled grammar is shared.

Copies of one matcher also share its lexer's state cache, behind one lock: the parallel mask
fill of many rows under one grammar then runs about serially (H200 host, 165 rows, 12
threads: 34 ms a step from one template, 7 ms from 12, 6 ms from 24). So each grammar keeps up
to `TEMPLATES` independently compiled templates (the extra ones compiled in the background,
one more each time the grammar has more users than templates), hands its requests out round
robin over them, and the mask fill orders rows by template.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance

from pjinfer.structured_output.params import StructuredOutputsParams

CACHE_SIZE = 256  # compiled grammars kept (failures too: a bad schema is refused at once)
COMPILE_WORKERS = 2
# llguidance's own default: 80% of the CPUs, at most 32
MASK_THREADS = max(1, min(32, int(0.8 * (os.cpu_count() or 1))))
TEMPLATES = min(32, 2 * MASK_THREADS)  # independent compiles of one grammar (see above)
# Compact JSON (OpenAI's strict mode emits none either): free whitespace lets a model pad
# its output with blanks until max_tokens instead of closing the object.
JSON_OPTIONS = {"whitespace_flexible": False}
MAX_ERROR_CHARS = 500
_ECHO = re.compile(r"^\s*(\d+\s*\|.*|\^+)\s*$")  # "   1 | start: /a(b/" and "   ^" lines


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar for a constraint (not yet checked: see `GrammarCompiler`)."""
    kind = spec.kind
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.json, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                            defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(list(spec.choice)))
    return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted


def _error_message(spec: StructuredOutputsParams, error: str) -> str:
    """Name the field and say what is wrong, in the user's terms."""
    # llguidance's messages echo the source with carets under it: keep only the words
    lines = [ln.strip() for ln in error.splitlines() if ln.strip() and not _ECHO.match(ln)]
    error = " ".join(lines)[:MAX_ERROR_CHARS] or "rejected by llguidance"
    what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar",
            "choice": "choice list", "json_object": "JSON object grammar"}[spec.kind]
    if "Unimplemented keys" in error:
        return (f"structured_outputs.json uses an unsupported JSON schema keyword: {error}; "
                "remove it from the schema")
    return f"structured_outputs.{spec.kind} is not a valid {what}: {error}"


def result_of(future: Future) -> llguidance.LLMatcher:
    """A compile's matcher (waiting for it), or a fresh ValueError: re-raising the cached one
    would grow its traceback with every request that hits it."""
    error = future.exception()
    if error is not None:
        raise ValueError(str(error)) from None
    return future.result()


class CompiledGrammar:
    """One grammar's pristine matchers: the first compile, then (as more requests use the
    grammar, up to `limit`) more independent templates compiled in the background by `grow`.
    `matcher()` hands out copies round robin over the templates ready so far; a grammar one
    request uses never compiles another."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str, limit: int,
                 grow: Callable[[Callable[[], None]], Any]):
        self.tokenizer, self.grammar = tokenizer, grammar
        self.templates = [self._new()]  # only appended to (atomic under the GIL)
        self._limit, self._grow, self._requested = limit, grow, 1
        self._next = itertools.count()

    def _new(self) -> llguidance.LLMatcher:
        return llguidance.LLMatcher(self.tokenizer, self.grammar, log_level=0)

    def matcher(self) -> tuple[int, llguidance.LLMatcher]:
        """(template index, a fresh matcher at the grammar's start); called on one thread
        (the engine loop)."""
        n = next(self._next)
        if n >= self._requested and self._requested < self._limit:  # more users than copies
            self._requested += 1
            self._grow(self._add_template)
        templates = self.templates
        index = n % len(templates)
        return index, templates[index].deep_copy()

    def _add_template(self) -> None:
        self.templates.append(self._new())


class GrammarCompiler:
    """Thread-pool compiles with an LRU cache of futures keyed by `StructuredOutputsParams.key`.

    `tokenizer` is the Hugging Face tokenizer; `vocab_size` the model's logits width, which
    may exceed the tokenizer's: llguidance then masks the padding ids off itself.
    `templates`: independent compiles kept per grammar (see the module docstring).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int] | None,
                 templates: int = TEMPLATES):
        self._hf_tokenizer, self.vocab_size, self._eos = tokenizer, vocab_size, eos_token_ids
        self._templates = templates
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()  # the cache: held briefly, the engine loop takes it
        self._tokenizer_lock = threading.Lock()  # held while the tokenizer is built (slow)
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(COMPILE_WORKERS, thread_name_prefix="pjinfer-grammar")
        # extra templates: one thread, so they never delay a first compile
        self._extra = ThreadPoolExecutor(1, thread_name_prefix="pjinfer-grammar-templates")

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """The (possibly shared, possibly finished) compile of `spec`: a CompiledGrammar, or
        a ValueError naming the field."""
        if self._hf_tokenizer is None:
            raise ValueError("structured_outputs need a tokenizer and this model has none")
        with self._lock:
            future = self._cache.get(spec.key)
            if future is None:
                future = self._cache[spec.key] = self._pool.submit(self._compile, spec)
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(spec.key)
        return future

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """Wait for the compile (callers off the engine loop: the server's parse threads)."""
        return result_of(self.submit(spec))

    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary, built once (about 1 s for a 128k vocabulary)."""
        import llguidance.hf  # imports transformers (and PyTorch where installed): seconds

        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos)
            return self._ll_tokenizer

    def _compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        try:
            grammar = grammar_text(spec)
        except (ValueError, TypeError, RuntimeError) as e:
            raise ValueError(_error_message(spec, str(e))) from None
        tokenizer = self.tokenizer()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar,
                                                                                 tokenizer)
        if is_error:
            raise ValueError(_error_message(spec, messages[0]))
        compiled = CompiledGrammar(tokenizer, grammar, self._templates, self._extra.submit)
        if compiled.templates[0].is_error():
            raise ValueError(_error_message(spec, compiled.templates[0].get_error()))
        return compiled

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._extra.shutdown(wait=False, cancel_futures=True)
