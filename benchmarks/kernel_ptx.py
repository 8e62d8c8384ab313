"""A Pallas kernel as the H200 would run it, read without a GPU: Triton IR, PTX, SASS and
ptxas' register count for one tiling.

Decode kernels are bound by instructions more than bytes, so a variant can be judged before
device time: the kernel exported for CUDA (Pallas -> Triton IR) and compiled for sm_90a by the
`triton` package; recorded: the main loop's instruction mix per element a thread handles in
PTX and SASS (cuobjdump; `--sass FILE` / `--ttgir FILE` keep the listing / Triton's GPU IR),
shared memory, registers and spills (ptxas -v). Device times come from the benchmarks.

Needs the `triton` package (not a pjinfer dependency), e.g.
    python -m pip install triton==3.9.0 --no-deps --target /tmp/triton
    python -m pjinfer.benchmarks.kernel_ptx --triton-path /tmp/triton --kind int4 --tokens 16 \
        --out int4_t16.json [--block-n 128 --num-warps 4 ...: tiling fields over the default;
        --int4-offset: the int4 dot's 128 + u form; --float16-dot: fp8 dots over float16 x]
    python -m pjinfer.benchmarks.kernel_ptx --triton-path /tmp/triton --kind decode_attention \
        --kv-dtype float8_e4m3fn --out decode_fp8.json   # Llama-3-8B heads, pages of 16
        [--num-warps / --num-stages over the default tiling]
    (--kind ragged_attention: the mixed-step kernel, 2,048 query tokens of 256 sequences)
    python -m pjinfer.benchmarks.kernel_ptx --triton-path /tmp/triton --kind routed \
        --expert-dtype float8_e4m3fn --tokens 8 --out routed_fp8.json
    (--kind grouped / routed: the MoE expert GEMMs over Qwen3-30B-A3B's gate/up experts, 128
    x 2048 -> 1536, float or quantized (`--expert-dtype`; int4 and -block: 128-row K groups);
    grouped at --tokens x 8 rows; Qwen3's rotary_write (q/k norm, RoPE, KV write to a
    --kv-dtype cache) and moe_route (top-8 of 128))
Without it only the Triton IR's op counts are recorded. Triton writes some instructions
(conversions) as inline assembly, unindented: the loop mix counts those lines too.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

ATTENTION = ("decode_attention", "ragged_attention")  # the paged attention kernels
EXPERTS = ("grouped", "routed", "routed_down", "routed_swiglu")  # the MoE expert GEMMs
TOKEN_KERNELS = ("rotary_write", "moe_route")  # one program a token, default tiling
EXPERT_DTYPES = ("bfloat16", "float8_e4m3fn", "int8", "float8_e4m3fn-block", "int8-block",
                 "int4")
FIELDS = ("block_t", "block_n", "block_k", "unroll", "k_splits", "num_warps", "num_stages",
          "weight_operand")


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON record path")
    p.add_argument("--kind", default="int4",
                   choices=("int4", "int8", "fp8") + ATTENTION + EXPERTS + TOKEN_KERNELS)
    p.add_argument("--expert-dtype", default="bfloat16", choices=EXPERT_DTYPES,
                   help="grouped / routed: the experts' stored dtype (one byte: quantized, "
                        "a scale per channel; -block: per 128-row K group; int4: GPTQ "
                        "nibbles, g128)")
    p.add_argument("--kv-dtype", default="bfloat16", choices=("bfloat16", "float8_e4m3fn"),
                   help="attention: the cache's dtype (the query is bfloat16)")
    p.add_argument("--pages", type=int, default=None,
                   help="attention: pages per loop step (default: the kernel's)")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--n", type=int, default=14336)
    p.add_argument("--group-size", type=int, default=128, help="int4 group (GPTQ g128)")
    p.add_argument("--triton-path", default=None, help="folder holding the triton package")
    for f in FIELDS:
        p.add_argument(f"--{f.replace('_', '-')}", type=int, default=None)
    p.add_argument("--sass", default=None, help="also write the kernel's SASS (cuobjdump) here")
    p.add_argument("--ttgir", default=None,
                   help="also write Triton's GPU IR here (its shared-memory buffers: "
                        "ttg.local_alloc, and what cp.async fills: async_copy_global_to_local)")
    p.add_argument("--int4-offset", action="store_true",
                   help="int4 dots: the nibbles as bfloat16 128 + u (the tiling switch)")
    p.add_argument("--glu", action="store_true",
                   help="--kind grouped as the MoE layer runs it: rows gathered, silu epilogue")
    p.add_argument("--float16-dot", action="store_true",
                   help="fp8 dots over float16 x, e4m3 widened to float16 (the tiling switch)")
    a = p.parse_args(argv)
    if a.pages is not None and (a.pages < 1 or a.pages & (a.pages - 1)):
        p.error(f"--pages must be a power of two (Triton tiles), got {a.pages}")
    return a


def kernel_ttir(kind: str, tokens: int, k: int, n: int, group_size: int,
                overrides: dict[str, int]) -> tuple[str, object]:
    """(Triton IR text, tiling) of `quantized_matmul` on a [k, n] weight of `kind`."""
    import jax
    import jax.numpy as jnp

    from pjinfer.kernels.quantized_matmul import pick_block_sizes, quantized_matmul
    from pjinfer.quantization.weight import FP8, QuantizedWeight, packed_shape

    dtype = {"int4": jnp.uint8, "int8": jnp.int8, "fp8": FP8}[kind]
    packed = jax.ShapeDtypeStruct(packed_shape(kind, k, n), dtype)
    groups = k // group_size if kind == "int4" else 1
    w = QuantizedWeight(packed, jax.ShapeDtypeStruct((groups, n), jnp.float32), kind=kind,
                        zero_point=8.0 if kind == "int4" else 0.0)
    sizes = dataclasses.replace(pick_block_sizes(tokens, w), **overrides)
    captured = triton_ir(lambda x, w: quantized_matmul(x, w, block_sizes=sizes),
                         jax.ShapeDtypeStruct((tokens, k), jnp.bfloat16), w)
    if not captured:
        raise ValueError(f"{sizes.describe()} does not tile a {k} x {n} {kind} weight "
                         "(the reference would run): pick other tiling fields")
    return captured[0], sizes


def attention_ttir(kind: str, kv_dtype: str, pages: int,
                   overrides: dict | None = None) -> tuple[str, object, int]:
    """(Triton IR text, tiling, K/V elements a loop step reads) of the paged attention kernel
    `kind` ("decode_attention" or "ragged_attention") with Llama-3-8B's heads (32 query, 8 KV,
    128 wide), 16-token pages and a bfloat16 query (ragged: 2,048 tokens of 256 sequences);
    `overrides`: num_warps / num_stages of the tiling."""
    import jax
    import jax.numpy as jnp

    from pjinfer.kernels.common import AttentionParams
    from pjinfer.kernels.decode_attention import DecodeBlockSizes, decode_attention
    from pjinfer.kernels.metadata import AttentionMetadata
    from pjinfer.kernels.ragged_attention import RaggedBlockSizes, ragged_attention

    seqs, heads, kv_heads, dim, block, num_blocks, width = 256, 32, 8, 128, 16, 4096, 64
    attn = AttentionParams(scale=dim ** -0.5)
    cache = jax.ShapeDtypeStruct((num_blocks, block, kv_heads, dim), jnp.dtype(kv_dtype))
    tables = jax.ShapeDtypeStruct((seqs, width), jnp.int32)
    lens = jax.ShapeDtypeStruct((seqs,), jnp.int32)
    if kind == "decode_attention":
        sizes = DecodeBlockSizes(pages_per_compute_block=pages, **(overrides or {}))
        captured = triton_ir(lambda *a: decode_attention(*a, attn, block_sizes=sizes),
                             jax.ShapeDtypeStruct((seqs, heads, dim), jnp.bfloat16), cache,
                             cache, tables, lens)
    else:
        tokens = 2048
        sizes = RaggedBlockSizes(pages_per_compute_block=pages, **(overrides or {}))
        md = AttentionMetadata(jax.ShapeDtypeStruct((tokens,), jnp.int32), tables, lens,
                               jax.ShapeDtypeStruct((seqs + 1,), jnp.int32))
        captured = triton_ir(lambda q, k, v, md: ragged_attention(q, k, v, md, attn,
                                                                  block_sizes=sizes),
                             jax.ShapeDtypeStruct((tokens, heads, dim), jnp.bfloat16), cache,
                             cache, md)
    return captured[0], sizes, 2 * pages * block * dim


def experts_ttir(kind: str, dtype: str, tokens: int,
                 glu: bool = False) -> tuple[str, object, int]:
    """(Triton IR text, tiling, weight elements a loop step reads) of the grouped (`tokens`
    x top-8 rows, the default tiling for them) or routed (`tokens` rows, 2 K ranges) GEMM
    over Qwen3-30B-A3B's gate/up experts, `routed_swiglu` (the routed gate/up GEMM with
    silu(gate) * up in its epilogue, one K range) or `routed_down`: the routed FFN's down
    kernel (silu(gate) * up of gate/up's two K ranges as it loads), stored as `dtype` (one byte:
    values [E, N, K] and scales, `pjinfer.quantization.experts`). `glu`: the grouped GEMM as
    the MoE layer runs it (x's rows gathered through the sort order, the silu epilogue over
    half-width blocks)."""
    import types

    import jax
    import jax.numpy as jnp

    from pjinfer.kernels import ops
    from pjinfer.kernels.grouped_matmul import grouped_matmul
    from pjinfer.kernels.routed_matmul import routed_ffn, routed_matmul
    from pjinfer.kernels.routed_tiling import default_routed_tiling, swiglu_routed_tiling

    experts, k, n = 128, 2048, 1536
    values, scales, group = _expert_stack(dtype, experts, k, n)
    if kind == "grouped":
        rows = tokens * 8
        tiling = ops.grouped_tiling(rows, experts, k, n, glu=glu, k_group=group,
                                    int4=dtype == "int4")
        gathered = dict(lhs_rows=jnp.zeros((rows,), jnp.int32)) if glu else {}
        captured = triton_ir(lambda x, w, g, *s: grouped_matmul(
            x, w, g, rhs_scales=s[0] if s else None, **gathered, **tiling),
            jax.ShapeDtypeStruct((tokens if glu else rows, k), jnp.bfloat16), values,
            jax.ShapeDtypeStruct((experts,), jnp.int32), *scales)
        elements = tiling["block_k"] * tiling["block_n"] * (2 if tiling["glu"] else 1)
    elif kind == "routed_down":  # routed_ffn's second kernel: the activation as it loads
        down, down_scales, _ = _expert_stack(dtype, experts, n // 2, k)
        tiling = dict(num_warps=4, num_stages=3, k_splits=(2, 1))
        captured = triton_ir(lambda x, w, d, i, *s: routed_ffn(
            x, w, d, i, gate_up_scales=s[0] if s else None,
            down_scales=s[1] if s else None, **tiling),
            jax.ShapeDtypeStruct((tokens, k), jnp.bfloat16), values, down,
            jax.ShapeDtypeStruct((tokens, 8), jnp.int32), *scales, *down_scales)[1:]
        elements = 128 * 128  # routed_ffn's default blocks
    else:  # routed_swiglu: silu(gate) * up in the epilogue, the engine's tiling for it
        (bn, bk), _ = default_routed_tiling((experts, k, n), 8, group)
        tiling = dict(block_n=bn, block_k=bk, num_warps=4, num_stages=3, k_splits=2)
        if dtype.endswith("-block"):  # a block-wise checkpoint's scales: 128 x 128 blocks
            tiling.update(scale_cols=128)
        if kind == "routed_swiglu":
            tiling.update(k_splits=1, swiglu=True, block_n=swiglu_routed_tiling(
                (experts, k, n), 8, group)[0])
        captured = triton_ir(lambda x, w, i, *s: routed_matmul(
            x, w, i, per_assignment=False, rhs_scales=s[0] if s else None, **tiling),
            jax.ShapeDtypeStruct((tokens, k), jnp.bfloat16), values,
            jax.ShapeDtypeStruct((tokens, 8), jnp.int32), *scales)
        elements = tiling["block_k"] * tiling["block_n"] * (2 if kind == "routed_swiglu" else 1)
    sizes = types.SimpleNamespace(num_warps=tiling.get("num_warps", 4),
                                  num_stages=tiling.get("num_stages", 3), tiling=tiling)
    return captured[0], sizes, elements


def _expert_stack(dtype: str, experts: int, k: int, n: int) -> tuple[object, list, int | None]:
    """(values, [scales] or [], K group) shape structs of a [E, K, N] expert stack stored as
    `dtype`: a float one as it is, else `quantize_experts`' layout (`-block` and int4: a
    scale per 128-row K group)."""
    import jax
    import jax.numpy as jnp

    from pjinfer.quantization.experts import quantize_experts

    stack = jax.ShapeDtypeStruct((experts, k, n), jnp.bfloat16)
    if dtype == "bfloat16":
        return stack, [], None
    group = 128 if dtype == "int4" or dtype.endswith("-block") else None
    kind = {"float8_e4m3fn": "fp8", "int8": "int8", "int4": "int4"}[dtype.removesuffix("-block")]
    q = jax.eval_shape(lambda w: quantize_experts(w, kind, group), stack)
    return q.values, [q.scales], group


def rotary_ttir(kv_dtype: str, tokens: int) -> tuple[str, object, int]:
    """(Triton IR text, tiling, elements a program handles) of `rotary_write` at Qwen3's
    heads (32 query, 4 KV, 128 wide, per-head norm), `tokens` programs."""
    import types

    import jax
    import jax.numpy as jnp

    from pjinfer.kernels.common import AttentionParams
    from pjinfer.kernels.rotary_write import QKTransform, rotary_write

    heads, kv_heads, dim = 32, 4, 128
    bf16 = jnp.bfloat16
    cache = jax.ShapeDtypeStruct((4096, 16, kv_heads, dim), jnp.dtype(kv_dtype))
    vec = jax.ShapeDtypeStruct((tokens,), jnp.int32)
    angles = jax.ShapeDtypeStruct((tokens, dim // 2), jnp.float32)
    qk = QKTransform(angles, angles, jax.ShapeDtypeStruct((dim,), bf16),
                     jax.ShapeDtypeStruct((dim,), bf16))
    captured = triton_ir(lambda q, k, v, kc, vc, s, qk: rotary_write(
        q, k, v, kc, vc, s, qk, AttentionParams(dim ** -0.5)),
        jax.ShapeDtypeStruct((tokens, heads, dim), bf16),
        *[jax.ShapeDtypeStruct((tokens, kv_heads, dim), bf16)] * 2, cache, cache, vec, qk)
    sizes = types.SimpleNamespace(num_warps=4, num_stages=1)
    return captured[0], sizes, (heads + 2 * kv_heads) * dim


def route_ttir(kv_dtype: str, tokens: int) -> tuple[str, object, int]:
    """(Triton IR, tiling, logits a program reads) of `moe_route`: 128 experts, top-8."""
    import types

    import jax

    from pjinfer.kernels.moe_route import moe_route

    args = jax.ShapeDtypeStruct((tokens, 128), "bfloat16"), jax.ShapeDtypeStruct((tokens,), "int32")
    ttir = triton_ir(lambda x, v: moe_route(x, v, top_k=8, renormalize=True), *args)[0]
    return ttir, types.SimpleNamespace(num_warps=1, num_stages=1), 128


def triton_ir(fn, *args) -> list[str]:
    """The Triton IR text of every Pallas kernel `fn(*args)` lowers to for CUDA (exported,
    so no GPU is needed)."""
    import jax
    from jax._src.pallas.triton import pallas_call_registration as registration

    captured: list[str] = []
    lower = registration.lowering.lower_jaxpr_to_triton_module

    def capture(*a, **kw):
        result = lower(*a, **kw)
        captured.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    check = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    registration.lowering.lower_jaxpr_to_triton_module = capture
    try:
        jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[check])(*args)
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower
    return captured


def op_counts(text: str, pattern: str) -> dict[str, int]:
    """Occurrences of each op name `pattern` captures, most frequent first."""
    return dict(collections.Counter(re.findall(pattern, text, re.M)).most_common())


def main_loop(ptx: str) -> list[str]:
    """The PTX lines of the longest loop (a label and the branch back to it)."""
    lines = ptx.splitlines()
    best = (0, len(lines) - 1)
    found = False
    for i, line in enumerate(lines):
        label = re.match(r"^(\$L__BB\d+_\d+):", line)
        if not label:
            continue
        back = re.compile(r"bra(\.uni)?\s+" + re.escape(label.group(1)) + ";")
        j = next((j for j in range(i + 1, len(lines)) if back.search(lines[j])), None)
        if j is not None and (not found or j - i > best[1] - best[0]):
            best, found = (i, j), True
    return lines[best[0]:best[1] + 1]


def _make_ttir(ttir: str, workdir: Path) -> str:
    """The Triton IR after Triton's own TTIR passes (canonicalize, combine: e.g. a dot's sum
    folded into its accumulator), which `triton.compile` skips for an IR file but the GPU
    compile of a Pallas kernel runs."""
    from triton._C.libtriton import ir, nvidia
    from triton.backends.nvidia.compiler import CUDABackend

    raw = workdir / "pallas.ttir"
    raw.write_text(ttir)
    context = ir.context()
    ir.load_dialects(context)
    nvidia.load_dialects(context)
    module = ir.parse_mlir_module(str(raw), context)
    module.context = context
    return str(CUDABackend.make_ttir(module, {}, None, 90))


# a PTX instruction line (indented, or unindented inside an inline-assembly block): its op
LOOP_OP = r"^\s*(?:@!?%p\d+\s+)?([a-z][a-z0-9_]*)(?:\.[a-z0-9_]+)*\s"


def compile_sm90(ttir: str, sizes, elements: int, workdir: Path) -> dict:
    """Triton IR -> PTX (sm_90a) and ptxas -v: loop mix per element (`elements`: what one
    loop step handles over all threads), smem, registers."""
    import triton
    from triton.backends.compiler import GPUTarget

    src = workdir / "kernel.ttir"
    src.write_text(_make_ttir(ttir, workdir))
    kernel = triton.compile(str(src), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": sizes.num_warps,
                                     "num_stages": sizes.num_stages})
    ptx = kernel.asm["ptx"]
    (workdir / "kernel.ptx").write_text(ptx)
    (workdir / "kernel.ttgir").write_text(kernel.asm["ttgir"])
    loop = "\n".join(main_loop(ptx))
    mix = op_counts(loop, LOOP_OP)
    elements //= 32 * sizes.num_warps  # per thread
    bins = sorted((Path(triton.__file__).parent / "backends" / "nvidia" / "bin").glob("ptxas*"))
    ptxas = [b for b in bins if "blackwell" in b.name] or bins  # the newest PTX version
    out = subprocess.run([str(ptxas[0]), "-v", "--gpu-name", "sm_90a", str(workdir / "kernel.ptx"),
                          "-o", str(workdir / "kernel.cubin")], capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", out.stderr)
    spill = re.search(r"(\d+) bytes spill stores", out.stderr)
    sass = subprocess.run([str(bins[0].parent / "cuobjdump"), "-sass",
                           str(workdir / "kernel.cubin")], capture_output=True, text=True).stdout
    (workdir / "kernel.sass").write_text(sass)
    sass_mix = op_counts("\n".join(sass_loop(sass)), SASS_OP)
    return {"shared_bytes": kernel.metadata.shared, "loop_instructions": sum(mix.values()),
            "elements_per_thread_step": elements,
            "instructions_per_element": sum(mix.values()) / elements, "loop_mix": mix,
            "sass_loop_instructions": sum(sass_mix.values()),
            "sass_per_element": sum(sass_mix.values()) / elements, "sass_loop_mix": sass_mix,
            "sass_instructions": len(re.findall(SASS_OP, sass, re.M)),  # the whole kernel
            "registers": int(regs.group(1)) if regs else None,
            "spill_store_bytes": int(spill.group(1)) if spill else None,
            "ptxas": out.stderr.strip()[-400:]}


# a SASS instruction line of cuobjdump: /*0a60*/  [@P0] OPCODE[.modifiers] ...
SASS_OP = r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)"


def sass_loop(sass: str) -> list[str]:
    """The SASS lines of the longest backward branch (the main loop), what the SM issues."""
    lines = sass.splitlines()
    at = {int(m.group(1), 16): i for i, line in enumerate(lines)
          if (m := re.search(r"/\*([0-9a-f]{4,})\*/", line))}
    best = (0, -1)
    for i, line in enumerate(lines):
        branch = re.search(r"\bBRA\s+(0x[0-9a-f]+)", line)
        start = at.get(int(branch.group(1), 16)) if branch else None
        if start is not None and start < i and i - start > best[1] - best[0]:
            best = (start, i)
    return lines[best[0]:best[1] + 1]


def run(argv: list[str] | None = None) -> dict:
    import tempfile

    a = _args(argv)
    if a.triton_path:
        sys.path.insert(0, a.triton_path)
    overrides = {f: getattr(a, f) for f in FIELDS if getattr(a, f) is not None}
    overrides.update({f: True for f in ("int4_offset", "float16_dot") if getattr(a, f)})
    if a.kind in ATTENTION:
        pages = a.pages or (4 if a.kind == "decode_attention" else 2)  # the defaults' tilings
        tiling = {f: v for f, v in overrides.items() if f in ("num_warps", "num_stages")}
        if set(overrides) - set(tiling):
            raise SystemExit(f"--kind {a.kind} takes --pages, --num-warps and --num-stages, "
                             f"not {', '.join(sorted(set(overrides) - set(tiling)))}")
        ttir, sizes, elements = attention_ttir(a.kind, a.kv_dtype, pages, tiling)
        record = {"kind": a.kind, "kv_dtype": a.kv_dtype, "tiling": str(sizes)}
    elif a.kind in TOKEN_KERNELS:
        build = rotary_ttir if a.kind == "rotary_write" else route_ttir
        ttir, sizes, elements = build(a.kv_dtype, a.tokens)
        record = {"kind": a.kind, "kv_dtype": a.kv_dtype, "tokens": a.tokens,
                  "tiling": f"{sizes.num_warps} warps"}
    elif a.kind in EXPERTS:
        if overrides:
            raise SystemExit(f"--kind {a.kind} takes the default tiling (no tiling fields)")
        ttir, sizes, elements = experts_ttir(a.kind, a.expert_dtype, a.tokens, a.glu)
        record = {"kind": a.kind, "expert_dtype": a.expert_dtype, "tokens": a.tokens,
                  "glu": a.glu, "tiling": str(sizes.tiling)}
    else:
        ttir, sizes = kernel_ttir(a.kind, a.tokens, a.k, a.n, a.group_size, overrides)
        elements = sizes.unroll * sizes.block_k * sizes.block_n  # weight elements a step
        record = {"kind": a.kind, "tokens": a.tokens, "k": a.k, "n": a.n,
                  "tiling": sizes.describe()}
    record.update(block_sizes=(sizes.tiling if a.kind in EXPERTS else vars(sizes)
                               if a.kind in TOKEN_KERNELS else dataclasses.asdict(sizes)),
                  ttir_ops=op_counts(ttir, r"= ([a-z_]+\.[a-z_\.]+)"))
    try:
        import triton  # noqa: F401
    except ImportError:
        record["sm90"] = None  # the IR only; see the module docstring
    else:
        workdir = Path(tempfile.mkdtemp())
        record["sm90"] = compile_sm90(ttir, sizes, elements, workdir)
        for path, name in ((a.sass, "kernel.sass"), (a.ttgir, "kernel.ttgir")):
            if path:  # its folder made as --out's is
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                Path(path).write_text((workdir / name).read_text())
        sm = record["sm90"]
        print(f"{record['tiling']}: {sm['instructions_per_element']:.2f} PTX / "
              f"{sm['sass_per_element']:.2f} SASS instructions per element in the main loop "
              f"({sm['sass_instructions']} in the kernel), {sm['registers']} registers, "
              f"{sm['shared_bytes']} B shared", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    run()
