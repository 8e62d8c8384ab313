"""The demo model's bf16 greedy Zen lines: what quantized weights and fp8 caches must keep."""

from __future__ import annotations

import pytest

from pjinfer import LLM, SamplingParams
from pjinfer.demo import zen_lines
from pjinfer.demo.train import line_prompt

ZEN_PROMPTS = [line_prompt(line, zen_lines()) for line in zen_lines()]
ZEN_GREEDY = SamplingParams(temperature=0, max_tokens=24)


def first_lines(outputs) -> list[str]:
    return [out.outputs[0].text.split("\n")[0] for out in outputs]


@pytest.fixture(scope="session")
def bf16_zen() -> list[str]:
    return first_lines(LLM(dtype="bfloat16", warmup=False).generate(ZEN_PROMPTS, ZEN_GREEDY))
