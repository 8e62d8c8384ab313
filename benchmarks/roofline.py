"""Roofline of a Llama-family decoder workload: the bytes and FLOPs it needs, over ceilings.

A benchmark figure is read as a share of the least time the device could take for the same
work, so the work must be what the workload really needs, term by term (`Work`, written into
every record as `roofline.work`), not a round number such as "all parameters once per step".

Bytes (2 B per value in bf16; figures for Llama-3-8B):
- layer weights: every decoder layer's projections and norms, read once per step however many
  sequences it serves (32 layers x 218.1 M params: 13.96 GB).
- final norm (8 KB) and lm_head (vocab x hidden: 1.05 GB), once per step.
- embedding rows: one row of `hidden` values per processed token (8 KB). The vocab x hidden
  table is not streamed: a lookup reads the rows of the step's tokens, not the 1.05 GB.
- KV read: each sequence's cached K/V, once per step (131,072 B per cached position: 2 x 32
  layers x 8 kv heads x 128 x 2 B). The step's own new positions come from the step itself.
- KV written: the K/V of every processed token, once.
  Activations and logits are left out: a fused step need not send them through memory (f32
  logits would add 0.5 MB per sequence per step, 1.7% of a decode step at batch 512).
  A batch-1 decode step at 512 cached tokens: 13.96 + 1.05 GB + 67 MB = 15.08 GB.

FLOPs (a multiply-add is 2):
- layers: 2 x layer params per processed token (13.96 GFLOP per token).
- attention: QK^T and PV, 4 x layers x q heads x head_dim per (query, attended key) pair;
  causal, so a token attends to its prefix and itself: n tokens from scratch make n(n+1)/2
  pairs, not n^2.
- lm_head: 2 x vocab x hidden per logits row (1.05 GFLOP). The engine computes one row per
  sequence per step (`logits_indices` in pjinfer/engine/step.py), never one per prompt token;
  a workload needs one per generated token.
  The embedding lookup does no arithmetic.

Mixture of experts (Mixtral, Qwen-MoE): `layer_params` holds everything but the routed experts
(attention, norms, routers, shared experts, dense MLP layers), read every step as above. Each
MoE layer then reads the experts its step's tokens chose: exactly top_k for one token, and
E(1 - (1 - k/E)^T) on average for T tokens routed independently and uniformly (random weights
route near-uniformly; a trained model's skew only lowers the count), `expert_weight_bytes`.
FLOPs count the active parameters: 2 x (layer_params + MoE layers x k x one expert's
params) per token (active, with the embeddings: Qwen3-30B-A3B 3.3 of 30.5 G params,
Mixtral-8x7B 12.9 of 46.7).

Time: a step takes at least max(bytes / bandwidth, FLOPs / matmul rate), with the ceilings of
`pjinfer.benchmarks.ceilings` (measured in the same process, by the same kind of work). A latency
run is the sum of its steps' bounds; an offline workload is bounded by its total work, with the
weights read once per step and at least ceil(output tokens / max_num_seqs) steps.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, astuple, dataclass, replace
from typing import Any

from pjinfer.benchmarks.ceilings import Ceilings

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
STEP_FORMULA = "max(total_bytes / hbm_bytes_per_s, total_flops / matmul_flops_per_s)"


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The numbers of a model that its roofline and its ceiling measurement depend on."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_params: int  # all decoder layers together: projections and norms (no routed expert)
    tied_embeddings: bool
    dtype_bytes: int
    moe_layers: int = 0  # layers with routed experts
    num_experts: int = 0  # routed experts per MoE layer
    experts_per_token: int = 0  # top-k
    expert_params: int = 0  # one expert of one layer: gate, up and down
    # as stored, where they differ from params x dtype_bytes: quantized layers (packed values,
    # scales, zeros) and an fp8 KV cache (1 byte per element)
    layer_bytes: int | None = None
    kv_dtype_bytes: int | None = None
    expert_bytes: int | None = None  # one expert of one layer as stored (quantized: values
    # of a byte plus float32 scales)

    @classmethod
    def from_model_config(cls, cfg: Any, dtype: str = "auto") -> ModelShape:
        """From a pjinfer ModelConfig; `dtype` is the engine's (auto = the checkpoint's)."""
        name = cfg.dtype if dtype == "auto" else dtype
        tables = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
        moe = cfg.option("moe")
        experts = {}
        if moe is not None:
            experts = dict(moe_layers=sum(moe.sparse_layers), num_experts=moe.num_experts,
                           experts_per_token=moe.top_k,
                           expert_params=3 * cfg.hidden_size * moe.intermediate_size)
        routed = experts.get("moe_layers", 0) * experts.get("num_experts", 0) \
            * experts.get("expert_params", 0)
        return cls(num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
                   intermediate_size=cfg.intermediate_size, vocab_size=cfg.vocab_size,
                   num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                   head_dim=cfg.head_dim,
                   layer_params=cfg.num_params() - tables - cfg.hidden_size - routed,
                   tied_embeddings=cfg.tie_word_embeddings, dtype_bytes=_DTYPE_BYTES[name],
                   **experts)

    @property
    def active_expert_params(self) -> int:
        """Routed-expert params one token runs through, all layers (0 for a dense model)."""
        return self.moe_layers * self.experts_per_token * self.expert_params

    def experts_read(self, tokens: int) -> float:
        """Expected distinct experts a MoE layer reads for a step of `tokens` tokens."""
        if not self.num_experts or tokens <= 0:
            return 0.0
        e, k = self.num_experts, self.experts_per_token
        return e * (1.0 - (1.0 - k / e) ** tokens)

    @property
    def lm_head_params(self) -> int:
        """vocab x hidden, read by the logits matmul whether or not it is the embedding table."""
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        tables = self.lm_head_params * (1 if self.tied_embeddings else 2)
        routed = self.moe_layers * self.num_experts * self.expert_params
        return self.layer_params + routed + tables + self.hidden_size

    @property
    def weight_bytes(self) -> int:
        """The checkpoint's size; a step reads less (`step_weights`: no embedding table)."""
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one position across all layers (131,072 B for Llama-3-8B in bf16)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * (
            self.kv_dtype_bytes or self.dtype_bytes)

    @property
    def layer_weight_bytes(self) -> int:
        """Bytes a step reads for the decoder layers, packed where they are quantized."""
        return self.layer_bytes or self.layer_params * self.dtype_bytes

    @property
    def attention_flops_per_pair(self) -> int:
        """QK^T and PV of one query against one key, all heads and layers."""
        return 4 * self.num_layers * self.num_heads * self.head_dim

    def matmul_shapes(self, tokens: int) -> list[tuple[int, int, int]]:
        """(M, K, N) of a layer's projections over `tokens` rows: qkv, o, gate+up, down."""
        d, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads
        return [(tokens, d, q + 2 * kv * self.head_dim), (tokens, q, d),
                (tokens, d, 2 * self.intermediate_size), (tokens, self.intermediate_size, d)]


@dataclass(frozen=True, slots=True)
class Work:
    """Bytes moved and FLOPs done, one field per term of the module docstring."""

    layer_weight_bytes: int = 0
    expert_weight_bytes: int = 0
    final_norm_bytes: int = 0
    lm_head_bytes: int = 0
    embedding_row_bytes: int = 0
    kv_read_bytes: int = 0
    kv_write_bytes: int = 0
    layer_flops: int = 0
    attention_flops: int = 0
    lm_head_flops: int = 0

    def __add__(self, other: Work) -> Work:
        return Work(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def scaled(self, k: int) -> Work:
        return Work(*(k * v for v in astuple(self)))

    @property
    def total_bytes(self) -> int:
        return sum(v for k, v in asdict(self).items() if k.endswith("_bytes"))

    @property
    def total_flops(self) -> int:
        return self.layer_flops + self.attention_flops + self.lm_head_flops

    def memory_seconds(self, c: Ceilings) -> float:
        return self.total_bytes / c.hbm_bytes_per_s

    def compute_seconds(self, c: Ceilings) -> float:
        return self.total_flops / c.matmul_flops_per_s

    def seconds(self, c: Ceilings) -> float:
        """The least time this work can take: it must both move its bytes and do its FLOPs."""
        return max(self.memory_seconds(c), self.compute_seconds(c))

    def record(self) -> dict[str, int]:
        return {**asdict(self), "total_bytes": self.total_bytes,
                "total_flops": self.total_flops}


# ---- the work of steps and requests -------------------------------------------------------
def step_weights(shape: ModelShape, tokens: int = 1) -> Work:
    """What a step of `tokens` tokens reads once, whatever its batch: layers, final norm,
    lm_head, and (MoE) the experts those tokens chose."""
    b = shape.dtype_bytes
    per_expert = shape.expert_bytes or shape.expert_params * b
    experts = shape.moe_layers * shape.experts_read(tokens) * per_expert
    return Work(layer_weight_bytes=shape.layer_weight_bytes, expert_weight_bytes=round(experts),
                final_norm_bytes=shape.hidden_size * b, lm_head_bytes=shape.lm_head_params * b)


def sequence_work(shape: ModelShape, cached: int, new: int, logit_rows: int) -> Work:
    """One sequence's share of one step: `new` tokens after `cached` ones (weights apart)."""
    pairs = new * cached + new * (new + 1) // 2  # causal: each new token sees its prefix
    return Work(embedding_row_bytes=new * shape.hidden_size * shape.dtype_bytes,
                kv_read_bytes=cached * shape.kv_bytes_per_token,
                kv_write_bytes=new * shape.kv_bytes_per_token,
                layer_flops=2 * (shape.layer_params + shape.active_expert_params) * new,
                attention_flops=shape.attention_flops_per_pair * pairs,
                lm_head_flops=2 * shape.lm_head_params * logit_rows)


def decode_work(shape: ModelShape, cached: int, steps: int) -> Work:
    """`steps` one-token decode steps of one sequence that starts with `cached` positions.

    As `sequence_work(cached, steps)` (same tokens, pairs, logits rows), except that step j
    reads its whole cache again: cached + j positions, not the prefix once.
    """
    reads = steps * cached + steps * (steps - 1) // 2
    return replace(sequence_work(shape, cached, steps, logit_rows=steps),
                   kv_read_bytes=reads * shape.kv_bytes_per_token)


def request_work(shape: ModelShape, prompt_len: int, output_len: int) -> Work:
    """A whole request, weights apart: its prompt in one pass (which yields output token 1),
    then output_len - 1 decode steps; the last output token is never fed back."""
    prefill = sequence_work(shape, 0, prompt_len, logit_rows=min(output_len, 1))
    return prefill + decode_work(shape, prompt_len, max(output_len - 1, 0))


# ---- rooflines ------------------------------------------------------------------------------
def latency_roofline(shape: ModelShape, c: Ceilings, batch: int, input_len: int,
                     output_len: int) -> dict[str, Any]:
    """Best TTFT, TPOT and end-to-end time for one static batch (W1, W2), step by step."""
    weights = step_weights(shape, batch)
    prefill = step_weights(shape, batch * input_len) \
        + sequence_work(shape, 0, input_len, logit_rows=1).scaled(batch)
    decodes = [weights + sequence_work(shape, input_len + j, 1, logit_rows=1).scaled(batch)
               for j in range(output_len - 1)]
    step_s = [w.seconds(c) for w in decodes]
    tpot = statistics.fmean(step_s) if step_s else 0.0
    return {
        "ttft_s": prefill.seconds(c), "tpot_s": tpot,
        "e2e_s": prefill.seconds(c) + sum(step_s),
        "tpot_weights_only_s": weights.memory_seconds(c),
        "output_tokens_per_s": batch / tpot if tpot else 0.0,
        "decode_steps": len(decodes),
        "decode_steps_memory_bound": sum(w.memory_seconds(c) >= w.compute_seconds(c)
                                         for w in decodes),
        "formula": f"each step: {STEP_FORMULA}; tpot_s = mean over decode steps; "
                   "e2e_s = prefill + sum of decode steps",
        "work": {"prefill": prefill.record(), "first_decode_step": _first(decodes),
                 "all_decode_steps": sum(decodes, Work()).record()},
    }


def _first(steps: list[Work]) -> dict[str, int] | None:
    return steps[0].record() if steps else None


def throughput_roofline(shape: ModelShape, c: Ceilings, prompt_lens: Sequence[int],
                        output_lens: Sequence[int], max_num_seqs: int) -> dict[str, Any]:
    """Best time for a whole offline workload (W3, W4): the larger of its bandwidth and compute
    times. A step yields at most `max_num_seqs` output tokens and reads the weights once."""
    out_total = sum(output_lens)
    min_steps = -(-out_total // max_num_seqs)
    per_step = -(-(sum(prompt_lens) + out_total) // min_steps)  # tokens of an average step
    work = step_weights(shape, per_step).scaled(min_steps)
    for p, o in zip(prompt_lens, output_lens, strict=True):
        work += request_work(shape, p, o)
    elapsed = work.seconds(c)
    return {"elapsed_s": elapsed, "compute_s": work.compute_seconds(c),
            "memory_s": work.memory_seconds(c), "min_steps": min_steps,
            "output_tokens_per_s": out_total / elapsed,
            "total_tokens_per_s": (sum(prompt_lens) + out_total) / elapsed,
            "formula": f"elapsed_s = {STEP_FORMULA} over the whole workload",
            "work": work.record()}


def fraction(numerator: float | None, denominator: float | None) -> float | None:
    """Share of the roofline reached: call as (best, measured) for times, (measured, best) for
    rates, so 1.0 means at the roofline either way; None when either side is missing."""
    if not numerator or not denominator:
        return None
    return numerator / denominator


def latency_ratios(results: dict[str, Any], roof: dict[str, Any]) -> dict[str, float | None]:
    """Roofline time over measured median time (1.0 = at the roofline), each from the record's
    own `roofline` and `results` fields."""
    tpot = results["tpot_s"]["median"]
    return {"tpot_roofline_over_median": fraction(roof["tpot_s"], tpot),
            "tpot_weights_only_over_median": fraction(roof["tpot_weights_only_s"], tpot),
            "ttft_roofline_over_median": fraction(roof["ttft_s"], results["ttft_s"]["median"]),
            "e2e_roofline_over_median": fraction(roof["e2e_s"], results["e2e_s"]["median"])}


def throughput_ratios(results: dict[str, Any], roof: dict[str, Any]) -> dict[str, float | None]:
    """How much of the roofline was reached (1.0 = at the roofline); the first equals the larger
    of the other two, which say how far compute alone and memory alone would explain."""
    elapsed = results["elapsed_s"]
    return {
        "output_tokens_per_s_vs_roofline":
            fraction(results["output_tokens_per_s"], roof["output_tokens_per_s"]),
        "compute_s_over_elapsed": fraction(roof["compute_s"], elapsed),
        "memory_s_over_elapsed": fraction(roof["memory_s"], elapsed),
    }
