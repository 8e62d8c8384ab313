"""Which quantization a model uses: config.json's `quantization_config`, or the engine argument.

Kept free of JAX (the engine-argument table imports `QUANTIZATION_NAMES`). Field meanings
follow the producers: GPTQ (AutoGPTQ / GPTQModel: bits, group_size, desc_act, sym,
checkpoint_format), AWQ (AutoAWQ: bits, group_size, zero_point, version), compressed-tensors
(llm-compressor: format, config_groups[*].weights / format, ignore) and fp8 (vLLM / transformers:
activation_scheme, weight_block_size).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("pjinfer")

# on-the-fly methods quantize a float checkpoint at load; the others read a quantized one
ON_THE_FLY = ("fp8", "int8")
CHECKPOINT_METHODS = ("gptq", "awq", "compressed-tensors", "fp8")
QUANTIZATION_METHODS = ("awq", "compressed-tensors", "fp8", "gguf", "gptq", "int8")
# naive- and int-quantized store the same tensors (int-quantized: llm-compressor's W8A8 int8)
CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
_ALIASES = {"compressed_tensors": "compressed-tensors", "gptq_marlin": "gptq",
            "awq_marlin": "awq", "modelopt": "fp8", "fbgemm_fp8": "fp8"}
# NVIDIA ModelOpt's quant_algo values that are fp8 weights with a per-tensor or per-channel
# weight_scale (their static / per-token activation scales are not applied)
MODELOPT_FP8 = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN")
# what `quantization=` accepts: the methods and vLLM's names for their kernels' variants
QUANTIZATION_NAMES = QUANTIZATION_METHODS + tuple(sorted(_ALIASES))


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """One model's quantization. `from_checkpoint` False: quantize float weights at load."""

    method: str
    bits: int = 8
    group_size: int = -1  # -1: one group per output channel (the whole input dim)
    sym: bool = True
    desc_act: bool = False
    kind: str = "int"  # "int" or "float" (fp8) values
    fmt: str = ""  # compressed-tensors format; "gptq_v2" for GPTQ v2 zeros
    from_checkpoint: bool = True
    ignore: tuple[str, ...] = field(default=("lm_head",))
    block: tuple[int, int] | None = None  # fp8 weight_block_size [out, in]: scales per block

    def __post_init__(self) -> None:
        if self.method not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization method {self.method!r} is not supported; "
                             f"supported: {', '.join(QUANTIZATION_METHODS)}")
        supported = (8,) if self.kind == "float" or self.method == "int8" else (4, 8)
        if self.method == "awq":
            supported = (4,)
        if self.bits not in supported:
            raise ValueError(f"{self.method}: {self.bits}-bit weights are not supported; "
                             f"supported: {', '.join(map(str, supported))} bits")
        if self.group_size != -1 and (self.group_size <= 0 or self.group_size % 2):
            raise ValueError(f"{self.method}: group_size must be -1 or a positive even number, "
                             f"got {self.group_size}")

    @property
    def weight_kind(self) -> str:
        """The canonical `QuantizedWeight.kind` its weights load as."""
        return "fp8" if self.kind == "float" else f"int{self.bits}"

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> QuantConfig:
        """Parse a config.json `quantization_config` (or ModelOpt's hf_quant_config.json,
        as `{"quant_method": "modelopt", **its "quantization"}`)."""
        if raw.get("quant_method") == "modelopt":
            _check_modelopt(raw)
        method = _ALIASES.get(raw.get("quant_method", ""), raw.get("quant_method", ""))
        if method == "gptq":
            fmt = raw.get("checkpoint_format", "gptq")
            return cls("gptq", int(raw.get("bits", 4)), int(raw.get("group_size", 128)),
                       bool(raw.get("sym", True)), bool(raw.get("desc_act", False)),
                       fmt=fmt)
        if method == "awq":
            if str(raw.get("version", "gemm")).lower() != "gemm":
                raise ValueError(f"awq: version {raw.get('version')!r} is not supported; "
                                 "pjinfer reads AWQ GEMM checkpoints")
            return cls("awq", int(raw.get("bits", raw.get("w_bit", 4))),
                       int(raw.get("group_size", raw.get("q_group_size", 128))),
                       sym=not raw.get("zero_point", True))
        if method == "compressed-tensors":
            return _compressed_tensors(raw)
        if method == "fp8":
            block = _fp8_block(raw.get("weight_block_size"))
            return cls("fp8", 8, block[1] if block else -1, kind="float", block=block)
        raise ValueError(f"config.json quantization_config: quant_method {method!r} is not "
                         f"supported; supported: {', '.join(CHECKPOINT_METHODS)}")

    @classmethod
    def on_the_fly(cls, method: str) -> QuantConfig:
        return cls(method, 8, kind="float" if method == "fp8" else "int",
                   from_checkpoint=False)


def _json(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    return raw


def _check_modelopt(raw: dict[str, Any]) -> None:
    algo = raw.get("quant_algo") or (raw.get("quantization") or {}).get("quant_algo")
    if algo not in MODELOPT_FP8:
        raise ValueError(f"ModelOpt quant_algo {algo!r} is not supported; pjinfer reads "
                         f"ModelOpt checkpoints quantized with {' or '.join(MODELOPT_FP8)}")


def _fp8_block(raw: Any) -> tuple[int, int] | None:
    """`weight_block_size` [out, in] of a block-wise fp8 checkpoint (DeepSeek-V3, Qwen3-FP8:
    one `weight_scale_inv` per block; compressed-tensors' `block_structure`, one
    `weight_scale`), or None."""
    if not raw:
        return None
    if not (isinstance(raw, list | tuple) and len(raw) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in raw)):
        raise ValueError(f"fp8: weight_block_size / block_structure must be two positive "
                         f"integers [out, in], got {raw!r}")
    return int(raw[0]), int(raw[1])


def _compressed_tensors(raw: dict[str, Any]) -> QuantConfig:
    """One weights scheme for every Linear (the W4A16 / W8A16 / W8A8 / FP8 presets, their
    asymmetric and act-order variants); a group's own `format` overrides the top level's."""
    groups = list((raw.get("config_groups") or {}).values())
    if len(groups) != 1 or not groups[0].get("weights"):
        raise ValueError("compressed-tensors: exactly one config group with a weights scheme "
                         f"is supported, got {len(groups)}")
    fmt = groups[0].get("format") or raw.get("format", "")
    w = groups[0]["weights"]
    strategy = w.get("strategy", "tensor")
    if fmt not in CT_FORMATS:
        raise ValueError(f"compressed-tensors: format {fmt!r} is not supported; supported: "
                         f"{', '.join(CT_FORMATS)}")
    if strategy not in ("group", "channel", "tensor", "block") or (
            strategy == "block" and w.get("type") != "float"):
        raise ValueError(f"compressed-tensors: weight strategy {strategy!r} is not supported"
                         + (" for int weights" if strategy == "block" else ""))
    actorder = w.get("actorder")
    if actorder not in (None, False, True, "static", "weight", "group"):
        raise ValueError(f"compressed-tensors: actorder {actorder!r} is not supported; "
                         "supported: group, weight, static")
    block = _fp8_block(w.get("block_structure")) if strategy == "block" else None
    if strategy == "block" and block is None:
        raise ValueError("compressed-tensors: a block weight strategy needs block_structure "
                         "[out, in]")
    _log_activations(groups[0].get("input_activations"), w.get("type", "int"))
    group = int(w["group_size"]) if strategy == "group" else block[1] if block else -1
    # "weight" and "static" orders keep each group's rows contiguous: only "group" stores
    # a weight_g_idx (True is its old spelling)
    return QuantConfig("compressed-tensors", int(w.get("num_bits", 8)), group,
                       bool(w.get("symmetric", True)), desc_act=actorder in (True, "group"),
                       kind=w.get("type", "int"), fmt=fmt,
                       ignore=tuple(raw.get("ignore") or ("lm_head",)), block=block)


def _log_activations(acts: dict | None, weight_type: str) -> None:
    """Int8 activation schemes (W8A8 int8) run weight-only: say so once, at load."""
    if acts and acts.get("type", "int") == "int" and weight_type == "int":
        log.info("compressed-tensors: the checkpoint's %d-bit int activation quantization is "
                 "not applied; activations stay in the model dtype (weight-only int "
                 "weights)", int(acts.get("num_bits", 8)))


def resolve(model_dir: str | Path | None, quantization: str | None,
            hf_config_path: str | Path | None = None) -> QuantConfig | None:
    """The model's quantization: the checkpoint's, which `quantization` may only confirm
    (an fp8 checkpoint with "fp8"), else the on-the-fly method `quantization` names. The
    checkpoint's is a GGUF file's own, else config.json's (`hf_config_path`'s when given)."""
    from pjinfer.quantization.gguf_file import gguf_path

    named, quantization = quantization, _ALIASES.get(quantization, quantization)
    if gguf_path(model_dir) is not None:  # per-tensor types; Q8_0 / Q4_0 stay packed
        if quantization not in (None, "gguf"):
            raise ValueError(f"quantization={quantization!r} does not match the checkpoint, "
                             "a GGUF file; leave quantization unset")
        return QuantConfig("gguf", 8, 32)
    raw = None
    folder = hf_config_path if hf_config_path is not None else model_dir
    path = Path(folder) / "config.json" if folder is not None else None
    if path is not None and path.is_file():
        raw = _json(path).get("quantization_config")
    modelopt = Path(folder) / "hf_quant_config.json" if folder is not None else None
    if not raw and modelopt is not None and modelopt.is_file():  # NVIDIA ModelOpt's export
        raw = {"quant_method": "modelopt", **(_json(modelopt).get("quantization") or {})}
    if raw:
        qcfg = QuantConfig.from_hf(raw)
        if quantization not in (None, qcfg.method):
            raise ValueError(f"quantization={quantization!r} does not match the checkpoint, "
                             f"which is quantized with {qcfg.method!r} (config.json "
                             "quantization_config); leave quantization unset")
        return qcfg
    if quantization is None:
        return None
    if named not in ON_THE_FLY:  # modelopt / fbgemm_fp8 name checkpoints, not a method
        raise ValueError(f"quantization={named!r} needs a checkpoint quantized with it "
                         f"(config.json has no quantization_config); a float checkpoint can be "
                         f"quantized at load with {' or '.join(ON_THE_FLY)}")
    return QuantConfig.on_the_fly(quantization)
