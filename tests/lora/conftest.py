"""Tiny random Llama and Qwen2 models with PEFT adapters (non-zero A and B), built once, and
the `peft` oracle: greedy tokens and their logprobs from each adapter's own PeftModel."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import TINY

# name -> (r, lora_alpha, use_rslora, target_modules)
ADAPTERS = {
    "all7": (8, 16, False, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj"]),
    "qv_rs": (4, 8, True, ["q_proj", "v_proj"]),
    "mlp16": (16, 8, False, ["o_proj", "gate_proj", "up_proj", "down_proj"]),
}
BASES = {"llama": ("LlamaConfig", {}), "qwen2": ("Qwen2Config", {"use_sliding_window": False}),
         "phi3": ("Phi3Config", {})}  # Phi-3: fused qkv_proj and gate_up_proj


@dataclass
class LoRAModels:
    base: Path  # the base model folder
    adapters: dict[str, Path]  # adapter name -> PEFT folder


def build_base(root: Path, name: str) -> Path:
    import torch
    import transformers

    cls_name, overrides = BASES[name]
    config = getattr(transformers, cls_name)(**{**TINY, **overrides})
    torch.manual_seed(len(name))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(root / name, safe_serialization=True)
    return root / name


def build_adapter(base: Path, out: Path, name: str, r: int, alpha: float, rslora: bool,
                  targets: list[str], seed: int) -> Path:
    """A PEFT adapter with random A and B (PEFT starts B at zero: no effect to test)."""
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora, target_modules=targets,
                          lora_dropout=0.0, task_type="CAUSAL_LM")
    pm = peft.get_peft_model(model, cfg)
    torch.manual_seed(seed)
    with torch.no_grad():
        for pname, p in pm.named_parameters():
            if "lora_" in pname:
                p.copy_(torch.randn_like(p) * 0.3)
    pm.save_pretrained(out / name, safe_serialization=True)
    return out / name


def make_models(root: Path, base_name: str) -> LoRAModels:
    base = build_base(root, base_name)
    adapters = {name: build_adapter(base, root / f"{base_name}-adapters", name, *spec, seed=i)
                for i, (name, spec) in enumerate(ADAPTERS.items())}
    return LoRAModels(base, adapters)


def peft_greedy(models: LoRAModels, adapter: str | None, prompt: list[int],
                max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from the base model with `adapter` (None: none)."""
    return _peft_greedy(models.base, models.adapters.get(adapter), tuple(prompt), max_tokens)


@functools.cache
def _peft_greedy(base: Path, adapter: Path | None, prompt: tuple[int, ...],
                 max_tokens: int) -> tuple[list[int], list[float]]:
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    model.eval()
    ids, tokens, logprobs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].double()
            lp = torch.log_softmax(logits, -1)
            token = int(torch.argmax(lp))
            tokens.append(token)
            logprobs.append(float(lp[token]))
            ids.append(token)
    return tokens, logprobs


@pytest.fixture(scope="session")
def llama_lora(tmp_path_factory) -> LoRAModels:
    return make_models(tmp_path_factory.mktemp("lora_llama"), "llama")


@pytest.fixture(scope="session")
def qwen2_lora(tmp_path_factory) -> LoRAModels:
    return make_models(tmp_path_factory.mktemp("lora_qwen2"), "qwen2")
