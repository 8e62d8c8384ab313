"""A PEFT LoRA folder read into host arrays, checked against the base model.

PEFT saves `adapter_config.json` (r, lora_alpha, use_rslora, target_modules ...) and
`adapter_model.safetensors` with, per adapted Linear, `...layers.{i}.self_attn.q_proj.lora_A.
weight` [r, in] and `...lora_B.weight` [out, r]; the adapted layer computes
W x + (B A x) * scaling, scaling = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora).
Here A is stored input-major [in, r] like pjinfer's weights and the scaling is folded into B
[r, out], so the device math is two plain matmuls. A checkpoint with fused projections (Phi-3's
qkv_proj, gate_up_proj) adapts the fused Linear: its A is shared and its B's rows are split
over the unfused params pjinfer keeps (q/k/v, gate/up), each part its column range.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pjinfer.config import ModelConfig
from pjinfer.errors import ModelLoadError
from pjinfer.weights import SafetensorsIndex

# The Linear layers an adapter may target, by PEFT module name (pjinfer's param names).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj",
                                                                                "up_proj")}
_TENSOR = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")

Key = tuple[int, str]  # (layer, target module)


class LoRALoadError(ModelLoadError):
    """An adapter folder that cannot serve this base model (the message says why)."""


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    """One adapter's weights on the host, float32, scaling folded into B."""

    name: str
    rank: int  # the largest rank over its modules
    weights: dict[Key, tuple[np.ndarray, np.ndarray]]  # (A [in, r], B [r, out])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of every adaptable Linear of one layer of `cfg` (the same in every layer)."""
    shapes = {}
    for p in cfg.param_specs():
        if p.path[0] == "layers" and p.path[1] == 0 and p.path[-1] in TARGET_MODULES:
            shapes[p.path[-1]] = tuple(p.shape)
    return shapes


def _read_config(folder: Path, name: str) -> dict:
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise LoRALoadError(f"LoRA {name!r}: {folder} has no adapter_config.json (a PEFT "
                            "adapter folder holds adapter_config.json and "
                            "adapter_model.safetensors)")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoRALoadError(f"LoRA {name!r}: {path} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise LoRALoadError(f"LoRA {name!r}: {path} must hold a JSON object")
    return config


def _check_config(config: dict, name: str, max_rank: int) -> tuple[int, float, bool]:
    """(r, lora_alpha, use_rslora), after refusing what this loader cannot apply exactly."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRALoadError(f"LoRA {name!r}: peft_type {peft_type!r} is not supported; only "
                            "LORA adapters are")
    if config.get("use_dora"):
        raise LoRALoadError(f"LoRA {name!r}: DoRA adapters (use_dora) are not supported")
    if config.get("alpha_pattern") or config.get("rank_pattern"):
        raise LoRALoadError(f"LoRA {name!r}: per-module rank_pattern / alpha_pattern are not "
                            "supported; train with one r and lora_alpha")
    r, alpha = config.get("r"), config.get("lora_alpha", 8)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise LoRALoadError(f"LoRA {name!r}: adapter_config.json needs a positive integer r, "
                            f"got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise LoRALoadError(f"LoRA {name!r}: lora_alpha must be a number, got {alpha!r}")
    if r > max_rank:
        raise LoRALoadError(f"LoRA {name!r}: rank r={r} exceeds max_lora_rank={max_rank}; "
                            f"start the engine with max_lora_rank >= {r}")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        known = set(TARGET_MODULES) | set(FUSED_MODULES)
        unknown = sorted(set(targets) - known)
        if unknown:
            raise LoRALoadError(f"LoRA {name!r}: unknown target module(s) {', '.join(unknown)}; "
                                f"supported: {', '.join(sorted(known))}")
    return r, float(alpha), bool(config.get("use_rslora", False))


def _read_tensors(folder: Path, name: str) -> dict[tuple[int, str, str], np.ndarray]:
    """(layer, module, "A" | "B") -> tensor, for every tensor of the safetensors file."""
    if not (folder / "adapter_model.safetensors").is_file():
        raise LoRALoadError(f"LoRA {name!r}: {folder} has no adapter_model.safetensors (save "
                            "the adapter with safe_serialization=True)")
    try:
        index = SafetensorsIndex(folder)
        tensors = {}
        for tensor_name in index.names():
            match = _TENSOR.search(tensor_name)
            if match is None:
                raise LoRALoadError(f"LoRA {name!r}: tensor {tensor_name!r} is not a LoRA A/B "
                                    "weight of a decoder layer (modules_to_save, embedding and "
                                    "bias adapters are not supported)")
            layer, module, ab = int(match[1]), match[2], match[3]
            tensors[layer, module, ab] = np.asarray(index.get(tensor_name), np.float32)
    except (OSError, ValueError, KeyError, struct.error) as e:
        if isinstance(e, LoRALoadError):
            raise
        raise LoRALoadError(f"LoRA {name!r}: adapter_model.safetensors in {folder} cannot be "
                            f"read ({type(e).__name__}: {e})") from None
    if not tensors:
        raise LoRALoadError(f"LoRA {name!r}: adapter_model.safetensors holds no tensors")
    return tensors


def _split_fused(module: str, b: np.ndarray, shapes: dict[str, tuple[int, int]],
                 name: str) -> list[tuple[str, np.ndarray]]:
    """B [r, out] of a fused module -> (part, its columns) for each unfused part."""
    parts = FUSED_MODULES.get(module, (module,))
    widths = [shapes[p][1] for p in parts if p in shapes]
    if len(widths) != len(parts) or b.shape[1] != sum(widths):
        raise LoRALoadError(f"LoRA {name!r}: {module} lora_B has {b.shape[1]} output rows but "
                            f"this model's {module} has {sum(widths)}: the adapter was trained "
                            "for another base model")
    bounds = np.cumsum([0, *widths])
    return [(p, b[:, bounds[i]:bounds[i + 1]]) for i, p in enumerate(parts)]


def load_adapter(name: str, path: str, cfg: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read and check a PEFT folder for base model `cfg`; LoRALoadError says what is wrong."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoRALoadError(f"LoRA {name!r}: {path!r} is not a local folder (pjinfer loads PEFT "
                            "adapters from disk)")
    r, alpha, rslora = _check_config(_read_config(folder, name), name, max_rank)
    scaling = alpha / (math.sqrt(r) if rslora else r)
    shapes = module_shapes(cfg)
    tensors = _read_tensors(folder, name)
    weights: dict[Key, tuple[np.ndarray, np.ndarray]] = {}
    for (layer, module, ab), t in tensors.items():
        if ab == "B":
            continue
        if module not in shapes and module not in FUSED_MODULES:
            raise LoRALoadError(f"LoRA {name!r}: unknown target module {module!r}; supported: "
                                f"{', '.join(sorted([*shapes, *FUSED_MODULES]))}")
        if layer >= cfg.num_hidden_layers:
            raise LoRALoadError(f"LoRA {name!r}: adapts layer {layer} but the base model has "
                                f"{cfg.num_hidden_layers}: trained for another base model")
        b = tensors.get((layer, module, "B"))
        if b is None or t.ndim != 2 or b.ndim != 2 or b.shape[1] != t.shape[0]:
            raise LoRALoadError(f"LoRA {name!r}: layer {layer} {module} needs lora_A [r, in] and "
                                "lora_B [out, r] of the same rank")
        if t.shape[0] > max_rank:
            raise LoRALoadError(f"LoRA {name!r}: rank {t.shape[0]} exceeds max_lora_rank="
                                f"{max_rank}; start the engine with max_lora_rank >= "
                                f"{t.shape[0]}")
        a = t.T  # [in, r]
        for part, b_part in _split_fused(module, b.T * np.float32(scaling), shapes, name):
            if a.shape[0] != shapes[part][0]:
                raise LoRALoadError(f"LoRA {name!r}: {module} lora_A takes {a.shape[0]} inputs "
                                    f"but this model's {part} takes {shapes[part][0]}: the "
                                    "adapter was trained for another base model")
            weights[layer, part] = (np.ascontiguousarray(a), np.ascontiguousarray(b_part))
    if any((layer, m, "A") not in tensors for layer, m, ab in tensors if ab == "B"):
        raise LoRALoadError(f"LoRA {name!r}: a lora_B weight has no lora_A")
    return LoRAAdapter(name, max(a.shape[1] for a, _ in weights.values()), weights)
