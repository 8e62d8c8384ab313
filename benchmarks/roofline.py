"""Roofline arithmetic for a Llama-family decoder, and the two ceilings measured on the device.

Every benchmark reports its figure next to the best the hardware could do, so a number is read
as "x% of what is possible" rather than in isolation:
- bandwidth roofline: a decode step must read every weight once plus the KV cache of every
  sequence in the batch; its time is at least those bytes over the measured HBM bandwidth.
  Weight bytes count the whole embedding table, as PERF_NOTES does (16.06 GB for Llama-3-8B); the
  step really reads only B rows of it, so the bound is ~6% loose for that model.
- compute roofline: 2 * params FLOPs per token processed (one multiply-add per weight) plus
  attention (QK^T and PV: 4 * layers * heads * head_dim per attended position), over the
  measured bf16 matmul rate.
The ceilings are measured in the same process as the run (the machines are shared and vary).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The few numbers of a model that its roofline depends on."""

    num_params: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int

    @classmethod
    def from_model_config(cls, cfg: Any, dtype: str = "auto") -> ModelShape:
        """From a pjinfer ModelConfig; `dtype` is the engine's (auto = the checkpoint's)."""
        name = cfg.dtype if dtype == "auto" else dtype
        return cls(num_params=cfg.num_params(), num_layers=cfg.num_hidden_layers,
                   num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                   head_dim=cfg.head_dim, dtype_bytes=_DTYPE_BYTES[name])

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one position across all layers (131,072 B for Llama-3-8B in bf16)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def attention_flops(self, attended: int) -> int:
        """QK^T and PV for queries that together attend to `attended` key positions."""
        return 4 * self.num_layers * self.num_heads * self.head_dim * attended

    def flops(self, tokens: int, attended: int) -> int:
        return 2 * self.num_params * tokens + self.attention_flops(attended)


@dataclass(frozen=True, slots=True)
class Ceilings:
    """Measured (or given) device limits: bytes/s counting read + write, and bf16 FLOP/s."""

    hbm_bytes_per_s: float
    matmul_flops_per_s: float
    source: str  # "measured" or "given"
    details: dict | None = None


# ---- decode steps and latency ------------------------------------------------------------
def decode_step_bytes(shape: ModelShape, context_lens: Sequence[int]) -> int:
    """Bytes one decode step must read: all weights, plus each sequence's cached K/V."""
    return shape.weight_bytes + shape.kv_bytes_per_token * sum(context_lens)


def decode_step_seconds(shape: ModelShape, c: Ceilings, context_lens: Sequence[int]) -> float:
    """Lower bound on one decode step: the larger of its bandwidth and compute times."""
    memory = decode_step_bytes(shape, context_lens) / c.hbm_bytes_per_s
    compute = shape.flops(len(context_lens), sum(context_lens)) / c.matmul_flops_per_s
    return max(memory, compute)


def prefill_seconds(shape: ModelShape, c: Ceilings, prompt_lens: Sequence[int]) -> float:
    """Lower bound on prefilling these prompts together (causal: a token sees its prefix)."""
    attended = sum(n * (n + 1) // 2 for n in prompt_lens)
    compute = shape.flops(sum(prompt_lens), attended) / c.matmul_flops_per_s
    return max(shape.weight_bytes / c.hbm_bytes_per_s, compute)


def latency_roofline(shape: ModelShape, c: Ceilings, batch: int, input_len: int,
                     output_len: int) -> dict[str, float]:
    """Best TPOT and end-to-end time for one static batch (W1, W2)."""
    steps = [decode_step_seconds(shape, c, [input_len + i] * batch)
             for i in range(1, output_len)]
    tpot = sum(steps) / len(steps) if steps else 0.0
    prefill = prefill_seconds(shape, c, [input_len] * batch)
    return {"tpot_s": tpot, "tpot_weights_only_s": shape.weight_bytes / c.hbm_bytes_per_s,
            "ttft_s": prefill, "e2e_s": prefill + sum(steps),
            "output_tokens_per_s": batch / tpot if tpot else 0.0}


# ---- throughput ----------------------------------------------------------------------------
def throughput_roofline(shape: ModelShape, c: Ceilings, prompt_lens: Sequence[int],
                        output_lens: Sequence[int], max_num_seqs: int) -> dict[str, float]:
    """Best time for a whole offline workload (W3, W4): max of its compute and bandwidth times.

    Bandwidth: each step yields at most `max_num_seqs` output tokens and reads all weights, and
    every output token reads its context's K/V once.
    """
    out_total = sum(output_lens)
    attended = sum(_attended(p, o) for p, o in zip(prompt_lens, output_lens, strict=True))
    compute = shape.flops(sum(prompt_lens) + out_total, attended) / c.matmul_flops_per_s
    min_steps = -(-out_total // max_num_seqs)
    kv_read = shape.kv_bytes_per_token * sum(
        o * p + o * (o - 1) // 2 for p, o in zip(prompt_lens, output_lens, strict=True))
    memory = (min_steps * shape.weight_bytes + kv_read) / c.hbm_bytes_per_s
    elapsed = max(compute, memory)
    tokens = sum(prompt_lens) + out_total
    return {"elapsed_s": elapsed, "compute_s": compute, "memory_s": memory,
            "output_tokens_per_s": out_total / elapsed,
            "total_tokens_per_s": tokens / elapsed,
            "compute_output_tokens_per_s": out_total / compute}


def _attended(prompt_len: int, output_len: int) -> int:
    """Key positions attended while prefilling `prompt_len` and decoding `output_len` tokens."""
    total = prompt_len + output_len
    return total * (total + 1) // 2 - 1 if output_len else prompt_len * (prompt_len + 1) // 2


def fraction(numerator: float | None, denominator: float | None) -> float | None:
    """Share of the roofline reached: call as (best, measured) for times, (measured, best) for
    rates, so 1.0 means at the roofline either way; None when either side is missing."""
    if not numerator or not denominator:
        return None
    return numerator / denominator


# ---- measuring the ceilings ------------------------------------------------------------------
def median_seconds(fn: Callable[[], Any], *, iters: int, warmup: int) -> float:
    """Median wall time of `fn()` (which must block until its device work is done)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_ceilings(*, copy_bytes: int | None = None, matmul_n: int | None = None,
                     iters: int = 10, warmup: int = 3) -> Ceilings:
    """HBM bandwidth from an elementwise pass (read + write) and bf16 FLOP/s from jnp.dot.

    Sizes default to 2 GiB and 8192^3 on accelerators (large enough to hide launch overhead)
    and 64 MiB and 512^3 on CPU (where only the plumbing matters).
    """
    import jax

    on_cpu = jax.default_backend() == "cpu"
    copy_bytes = copy_bytes or (64 << 20 if on_cpu else 2 << 30)
    matmul_n = matmul_n or (512 if on_cpu else 8192)
    copy_s = _time_copy(copy_bytes, iters, warmup)
    dot_s = _time_matmul(matmul_n, iters, warmup)
    details = {"copy_bytes": copy_bytes, "copy_median_s": copy_s, "matmul_n": matmul_n,
               "matmul_median_s": dot_s, "iters": iters, "warmup": warmup}
    return Ceilings(hbm_bytes_per_s=2 * copy_bytes / copy_s,
                    matmul_flops_per_s=2 * matmul_n**3 / dot_s, source="measured",
                    details=details)


def _time_copy(nbytes: int, iters: int, warmup: int) -> float:
    import jax
    import jax.numpy as jnp

    x = jnp.zeros(nbytes // 2, jnp.bfloat16)
    step = jax.jit(lambda a: a + jnp.ones((), a.dtype))  # XLA cannot elide it, unlike a copy
    seconds = median_seconds(lambda: step(x).block_until_ready(), iters=iters, warmup=warmup)
    return seconds


def _time_matmul(n: int, iters: int, warmup: int) -> float:
    import jax
    import jax.numpy as jnp

    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)  # random: zeros run ~13% faster on H200
    b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    dot = jax.jit(jnp.dot)
    seconds = median_seconds(lambda: dot(a, b).block_until_ready(), iters=iters, warmup=warmup)
    return seconds


def ceilings_from_args(args: Any) -> Ceilings | None:
    """--no-roofline: None; --hbm-bandwidth/--peak-tflops: given values; else measure."""
    if getattr(args, "no_roofline", False):
        return None
    if args.hbm_bandwidth and args.peak_tflops:
        return Ceilings(args.hbm_bandwidth * 1e12, args.peak_tflops * 1e12, source="given")
    return measure_ceilings()


def add_roofline_args(parser: Any) -> None:
    group = parser.add_argument_group("roofline")
    group.add_argument("--no-roofline", action="store_true",
                       help="skip measuring the ceilings and the roofline fields")
    group.add_argument("--hbm-bandwidth", type=float, default=None, metavar="TB/S",
                       help="use this bandwidth (read + write) instead of measuring it")
    group.add_argument("--peak-tflops", type=float, default=None, metavar="TFLOP/S",
                       help="use this bf16 matmul rate instead of measuring it")


def ceilings_record(c: Ceilings | None) -> dict | None:
    if c is None:
        return None
    out = asdict(c)
    out["hbm_tb_per_s"] = c.hbm_bytes_per_s / 1e12
    out["matmul_tflops"] = c.matmul_flops_per_s / 1e12
    return out
