"""Offline use: `pjinfer.generate(...)` and the `LLM` class (vLLM's offline API)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tqdm import tqdm

from pjinfer.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from pjinfer.engine.config import EngineConfig
from pjinfer.engine.engine import LLMEngine
from pjinfer.engine.run_to_completion import run_to_completion
from pjinfer.lora.request import LoRARequest
from pjinfer.outputs import RequestOutput
from pjinfer.sampling_params import RequestOutputKind, SamplingParams
from pjinfer.tokenizer import apply_chat_template

# text, token ids, or vLLM's TextPrompt / TokensPrompt dicts ({"prompt": ...} or
# {"prompt_token_ids": [...]})
Prompt = str | Sequence[int] | Mapping[str, Any]


class LLM:
    """Load a model once, then run batches of prompts through continuous batching.

    `LLM(model=None)` serves the embedded demo model; engine arguments use vLLM's names.
    A `config` (path to a TOML run config) supplies defaults that keyword arguments override.
    `plugins` names the plugins to load first (pjinfer.plugins; None: every installed one).
    """

    def __init__(self, model: str | None = None, *, config: str | None = None,
                 plugins: Sequence[str] | None = None, **engine_args):
        from pjinfer.plugins import load_plugins

        load_plugins(plugins)  # before the EngineConfig, which checks names they register
        if config is not None:
            from pjinfer.run_config import load_run_config

            engine_args = {**load_run_config(config).engine_args(), **engine_args}
        if model is not None:
            engine_args["model"] = model
        engine_args.setdefault("warmup", False)  # offline batches compile shapes as they come
        self.engine = LLMEngine(EngineConfig.from_kwargs(**engine_args))
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name for the engine behind the class (scripts reach it as `llm.llm_engine`)."""
        return self.engine

    def get_tokenizer(self) -> Any:
        """The model's tokenizer, as vLLM's `LLM.get_tokenizer()` returns it."""
        return self.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., tqdm] = True,
                 *, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 ) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in the order given. `use_tqdm`: a progress
        bar on stderr as prompts finish (as vLLM; a callable makes the bar in tqdm's place).
        `priority` (one int per prompt, lower first, as vLLM) orders them under
        `scheduling_policy="priority"`. `lora_request`: one adapter for every prompt, or one
        (or None: the base model) per prompt (needs `enable_lora=True`)."""
        prompts = _as_list(prompts)
        loras = _per_prompt(lora_request, len(prompts), "lora_request")
        params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
                  for p in _broadcast(sampling_params, len(prompts))]
        priorities = _priorities(priority, len(prompts))
        for p in params:  # a bad schema/regex/grammar: ValueError before anything runs
            if p.structured_outputs is not None:
                self.engine.structured_output.check(p.structured_outputs)
        ids = []
        try:
            for prompt, p, rank, lora in zip(prompts, params, priorities, loras, strict=True):
                ids.append(f"llm-{next(self._ids)}")
                self.engine.add_request(ids[-1], prompt, p, priority=rank, lora_request=lora)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, prompts, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., tqdm] = True,
             tools: list[dict[str, Any]] | None = None,
             *, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None,
             ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, or `chat_template` (and
        `tools`, OpenAI function definitions, for templates that show them;
        `chat_template_kwargs`, more of its variables), then generate. vLLM's arguments:
        `continue_final_message` (with add_generation_prompt=False) lets the model go on
        with the last assistant message."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [apply_chat_template(
            self.tokenizer, c, tools=tools, chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def beam_search(self, prompts: Prompt | Sequence[Prompt],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """The best `params.beam_width` sequences per prompt (vLLM's `LLM.beam_search`): one
        engine step per token over every live beam; turn on `enable_prefix_caching` so each
        step recomputes only the beams' newest tokens."""
        params.check_logprobs(self.engine.config.max_logprobs)
        search = BeamSearch([self.engine.prompt_ids(p) for p in _as_list(prompts)], params,
                            self.engine.eos_token_id)
        while not search.done:
            outs = self.generate(search.requests(), search.sampling_params(), use_tqdm=False)
            search.advance([out.outputs[0].logprobs[0] for out in outs])
        tokenizer = self.tokenizer
        return search.results(tokenizer.decode if tokenizer is not None else None)

    def _run(self, ids: list[str], prompts: list[Prompt], use_tqdm) -> list[RequestOutput]:
        bar = _progress_bar(use_tqdm, len(ids))
        try:
            done = run_to_completion(self.engine, ids,
                                     on_finished=bar.finished if bar is not None else None)
        finally:
            if bar is not None:
                bar.close()
        for rid, prompt in zip(ids, prompts, strict=True):
            done[rid].prompt = prompt if isinstance(prompt, str) else None
        return [done[rid] for rid in ids]


def generate(model: str | None, prompts: Prompt | Sequence[Prompt],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             *, use_tqdm: bool | Callable[..., tqdm] = True, **engine_args
             ) -> list[RequestOutput]:
    """One-shot: load `model` (None = the demo model), generate, return one output per prompt."""
    return LLM(model, **engine_args).generate(prompts, sampling_params, use_tqdm)


class _ProgressBar:
    """vLLM's offline progress bar: prompts finished, with the input and output token rates."""

    def __init__(self, factory: Callable[..., tqdm], total: int):
        self.bar = factory(total=total, desc="Processed prompts", dynamic_ncols=True)
        self.input_tokens = self.output_tokens = 0

    def finished(self, out: RequestOutput) -> None:
        self.input_tokens += len(out.prompt_token_ids)
        self.output_tokens += sum(len(c.token_ids) for c in out.outputs)
        elapsed = max(self.bar.format_dict.get("elapsed", 0.0), 1e-9)
        self.bar.set_postfix_str(f"est. speed input: {self.input_tokens / elapsed:.2f} toks/s, "
                                 f"output: {self.output_tokens / elapsed:.2f} toks/s",
                                 refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _progress_bar(use_tqdm: bool | Callable[..., tqdm], total: int) -> _ProgressBar | None:
    if not use_tqdm:
        return None
    return _ProgressBar(use_tqdm if callable(use_tqdm) else tqdm, total)


def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[str | list[int]]:
    if isinstance(prompts, str | Mapping):
        return [_plain(prompts)]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    if not prompts:
        raise ValueError("prompts must not be empty")
    return [_plain(p) for p in prompts]


def _plain(prompt: Prompt) -> str | Sequence[int]:
    """A vLLM prompt dict as its text or token ids; other prompts as they are."""
    if not isinstance(prompt, Mapping):
        return prompt
    keys = sorted(prompt)
    if keys == ["prompt"] and isinstance(prompt["prompt"], str):
        return prompt["prompt"]
    if keys == ["prompt_token_ids"] and not isinstance(prompt["prompt_token_ids"], str):
        return list(prompt["prompt_token_ids"])
    got = ", ".join(f"{k!r} ({type(prompt[k]).__name__})" for k in keys) or "no keys"
    raise ValueError(f"a prompt dict takes one key: 'prompt' (text) or 'prompt_token_ids' "
                     f"(a list of token ids); got {got} (multi-modal data, embeddings and "
                     "cache salts are not supported)")


def _broadcast(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling_params for {n} prompts; pass one, "
                         "or one per prompt")
    return list(params)


def _per_prompt(value, n: int, name: str) -> list:
    """One value for every prompt, or a list of one per prompt."""
    if not isinstance(value, list | tuple):
        return [value] * n
    if len(value) != n:
        raise ValueError(f"got {len(value)} {name}s for {n} prompts; pass one, or one per "
                         "prompt")
    return list(value)


def _priorities(priority: Sequence[int] | None, n: int) -> list[int]:
    if priority is None:
        return [0] * n
    if len(priority) != n or not all(isinstance(p, int) and not isinstance(p, bool)
                                      for p in priority):
        raise ValueError(f"priority must be a list of {n} integers (one per prompt), got "
                         f"{priority!r}")
    return list(priority)
