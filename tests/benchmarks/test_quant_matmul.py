"""The weight-only matmul benchmark runs end to end on CPU with tiny shapes (a smoke test)."""

from __future__ import annotations

import json

import pytest

from pjinfer.benchmarks import quant_matmul


def test_smoke(tmp_path):
    out = tmp_path / "q.json"
    quant_matmul.run(["--out", str(out), "--matrices", "2", "--k", "128", "--n", "128",
                      "--tokens", "1", "--kinds", "int4", "fp8", "--group-size", "64",
                      "--samples", "1", "--calls", "1"])
    record = json.loads(out.read_text())
    paths = {(r["path"], r["kind"]) for r in record["runs"]}
    assert paths == {("bf16", "bf16"), ("xla", "int4"), ("pallas", "int4"), ("xla", "fp8"),
                     ("pallas", "fp8"), ("w8a8", "fp8"), ("routed", "fp8")}
    int4 = next(r for r in record["runs"] if r["path"] == "pallas" and r["kind"] == "int4")
    # packed: 2 x 128 x 128 / 2 bytes of values + 2 x 2 x 128 float32 scales
    assert int4["weight_bytes"] == 2 * 128 * 64 + 2 * 2 * 128 * 4
    assert int4["fraction_of_bf16_gemv_bandwidth"] > 0


@pytest.mark.parametrize("sweep", [[], ["--sweep"]])
def test_each_row_count_is_written_as_it_finishes(tmp_path, monkeypatch, sweep):
    """A run stopped by its time limit keeps the row counts it finished: the record is
    written after each (round 48's call 5 lost its figures to a limit)."""
    out = tmp_path / "q.json"
    seen = []
    monkeypatch.setattr(quant_matmul, "write_record",
                        lambda path, record: seen.append(json.loads(json.dumps(record))))
    quant_matmul.run(["--out", str(out), "--matrices", "1", "--k", "128", "--n", "128",
                      "--tokens", "1", "2", "--kinds", "int8", "--samples", "1", "--calls",
                      "1", *sweep])
    if sweep:
        assert list(seen[0]["sweep"]["int8"]) == ["1"]
        assert list(seen[-1]["sweep"]["int8"]) == ["1", "2"]
    else:
        assert {r["tokens"] for r in seen[0]["runs"]} == {1}
        assert {r["tokens"] for r in seen[-1]["runs"]} == {1, 2}


@pytest.mark.parametrize("t, k, n", [(1, 256, 384), (8, 384, 640), (17, 128, 256)])
def test_routed_fp8_probe_matches_the_reference(t, k, n):
    """The probe's routed form: a per-channel fp8 weight as a one-expert stack (rows padded
    to 16 in the kernel, K cut into ranges or whole, N not a multiple of 128)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pjinfer.kernels.quantized_matmul import quantized_matmul_reference
    from pjinfer.quantization.weight import quantize_per_channel

    w = quantize_per_channel(jax.random.normal(jax.random.key(k), (k, n)) * 0.05, "fp8")
    x = jax.random.normal(jax.random.key(t), (t, k), jnp.float32)
    want = quantized_matmul_reference(x, w)
    got = quant_matmul.routed_fp8(x, w, interpret=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


def test_sweep_records_every_tiling_per_kind_and_tokens(tmp_path):
    out = tmp_path / "s.json"
    quant_matmul.run(["--out", str(out), "--sweep", "--matrices", "1", "--k", "64", "--n", "32",
                      "--tokens", "1", "--kinds", "int4", "--group-size", "32",
                      "--samples", "1", "--calls", "1"])
    sweep = json.loads(out.read_text())["sweep"]["int4"]["1"]
    tilings = [r["tiling"] for r in sweep["tilings"]]
    assert sweep["default"] in tilings and sweep["best"] == tilings[0]
    assert len(tilings) >= 5 and len(set(tilings)) == len(tilings)
    ms = [r["ms"] for r in sweep["tilings"]]
    assert ms == sorted(ms) and sweep["default_vs_best"] >= 1.0
    assert all(r["tb_per_s"] > 0 for r in sweep["tilings"])


def test_sweep_grid_times_each_combination(tmp_path):
    out = tmp_path / "g.json"
    quant_matmul.run(["--out", str(out), "--sweep", "--matrices", "1", "--k", "64", "--n", "32",
                      "--tokens", "1", "--kinds", "int4", "--group-size", "32",
                      "--samples", "1", "--calls", "1", "--grid", "num_warps=2,4",
                      "num_stages=2,3"])
    sweep = json.loads(out.read_text())["sweep"]["int4"]["1"]
    got = {(r["block_sizes"]["num_warps"], r["block_sizes"]["num_stages"])
           for r in sweep["tilings"]}
    assert {(2, 2), (2, 3), (4, 2), (4, 3)} <= got and sweep["default"] in {
        r["tiling"] for r in sweep["tilings"]}
    assert all(r["relative_error"] < quant_matmul.MAX_ERROR for r in sweep["tilings"])


def test_sweep_times_listed_tilings_in_rounds(tmp_path, capsys):
    """--tilings: the default, then the listed lines (one that does not tile this weight is
    skipped and said); --rounds: every tiling timed that many times, its best kept."""
    out = tmp_path / "t.json"
    lines = ["t16 n32 k64x1 s2 w4 st3 (dot+f16)", "t16 n32 k64x1 s1 w4 st3 (dot)",
             "t16 n64 k64x1 s1 w4 st3 (dot)"]  # 64 columns do not divide 32
    quant_matmul.run(["--out", str(out), "--sweep", "--matrices", "1", "--k", "128", "--n",
                      "32", "--tokens", "8", "--kinds", "fp8", "--samples", "1", "--calls",
                      "1", "--rounds", "2", "--tilings", *lines])
    sweep = json.loads(out.read_text())["sweep"]["fp8"]["8"]
    timed = {r["tiling"] for r in sweep["tilings"]}
    assert timed == {sweep["default"], *lines[:2]}
    assert all(len(r["round_ms"]) == 2 and r["ms"] == min(r["round_ms"])
               for r in sweep["tilings"])
    assert "skipped" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        quant_matmul.run(["--out", str(out), "--sweep", "--grid", "num_warps=4",
                          "--tilings", lines[0]])
    with pytest.raises(SystemExit):  # a mistyped line is refused before any work
        quant_matmul.run(["--out", str(out), "--sweep", "--tilings", "t16 n32 (dot)"])
    assert "--tilings: not a tiling line" in capsys.readouterr().err


def test_sweep_float16_twins_follow_each_fp8_dot(tmp_path):
    """--tilings with no lines: the default (and the rules' tiling, where a tuned one is the
    default) alone; --float16-twins adds each fp8 dot's float16_dot twin after it."""
    out = tmp_path / "f.json"
    quant_matmul.run(["--out", str(out), "--sweep", "--matrices", "1", "--k", "128", "--n",
                      "32", "--tokens", "8", "--kinds", "fp8", "--samples", "1", "--calls",
                      "1", "--tilings", "--float16-twins"])
    sweep = json.loads(out.read_text())["sweep"]["fp8"]["8"]
    timed = {r["tiling"] for r in sweep["tilings"]}
    assert timed == {sweep["default"], sweep["default"].replace("(dot)", "(dot+f16)")}


def test_profile_driver_launches_each_tiling_in_order():
    from pjinfer.benchmarks import quant_profile

    tilings = ["t16 n32 k64x1 s2 w4 st2 (dot)", "t1 n32 k64x1 s1 w4 st1 (sum)"]
    order = quant_profile.run(["--k", "128", "--n", "64", "--group-size", "64", "--repeat",
                               "2", "--tilings", *tilings])
    assert order == [tilings[0]] * 2 + [tilings[1]] * 2
    with pytest.raises(SystemExit, match="does not tile"):
        quant_profile.run(["--k", "128", "--n", "64", "--group-size", "64",
                           "--tilings", "t16 n48 k64x1 s2 w4 st2 (dot)"])


def test_kernel_check_records_error_and_rate(tmp_path):
    from pjinfer.benchmarks import quant_kernel_check

    out = tmp_path / "check.json"
    assert quant_kernel_check.main(["--matrices", "1", "--k", "256", "--n", "128",
                                    "--tokens", "1", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["device"]["device_kind"]
    for kind in ("int4", "int8", "fp8"):
        assert rec[f"{kind}_T1"]["rel_err"] < 1e-2 and rec[f"{kind}_T1"]["TBps"] > 0


def test_layers_times_grouped_and_per_weight_against_bf16(tmp_path):
    from pjinfer.benchmarks import quant_layers

    out = tmp_path / "l.json"
    quant_layers.run(["--out", str(out), "--layers", "1", "--hidden", "128",
                      "--intermediate", "256", "--q-width", "128", "--kv-width", "64",
                      "--tokens", "16", "--kinds", "int4", "--group-size", "64",
                      "--samples", "1", "--calls", "1"])
    runs = json.loads(out.read_text())["runs"]
    assert [(r["kind"], r["path"]) for r in runs] == [
        ("bf16", "bf16"), ("int4", "grouped"), ("int4", "per_weight")]
    # int4 values + float32 scales of 128 -> (128 + 64 + 64), 128 -> 128, 128 -> 2 x 256, 256 -> 128
    weights = 128 * 256 + 128 * 128 + 128 * 512 + 256 * 128
    assert runs[1]["weight_bytes"] == weights // 2 + 4 * weights // 64
    assert all(r["ms_per_step"] > 0 and r["speedup_vs_bf16"] > 0 for r in runs)


def test_kernel_ptx_reads_the_triton_ir_without_a_gpu(tmp_path):
    from pjinfer.benchmarks import kernel_ptx

    out = tmp_path / "p.json"
    record = kernel_ptx.run(["--out", str(out), "--kind", "int4", "--tokens", "16",
                             "--k", "256", "--n", "256", "--num-warps", "4"])
    assert record["tiling"].startswith("t16 ") and record["block_sizes"]["num_warps"] == 4
    assert record["ttir_ops"]["tt.dot"] >= 2 and record["ttir_ops"]["scf.for"] == 1
    assert json.loads(out.read_text())["tiling"] == record["tiling"]
    ptx = "\n".join(["$L__BB0_1:", "  shl.b32 %r1, %r2, 3;", "$L__BB0_2:", "  fma.rn.f32 %f1;",
                     "  @%p1 ld.shared.u8 %rs1;", "  @%p2 bra $L__BB0_2;", "  bra.uni $L__BB0_1;"])
    loop = kernel_ptx.main_loop(ptx)
    assert loop[0] == "$L__BB0_1:" and loop[-1].strip() == "bra.uni $L__BB0_1;"
    assert kernel_ptx.op_counts("\n".join(loop[3:5]), r"^\s+(?:@!?%p\d+ )?([a-z]+)") == {
        "fma": 1, "ld": 1}


@pytest.mark.parametrize("dtype, asm", [("int4", 2), ("float8_e4m3fn-block", 1),
                                        ("int8-block", 2)])
def test_kernel_ptx_reads_the_routed_kernel_over_grouped_expert_stacks(tmp_path, dtype, asm):
    """Qwen3's gate/up experts with 128-row K groups: the routed kernel's K step is one group
    (int4: one nibble block, its two halves through the inline-PTX bf16 pairs; fp8 and int8:
    a float16 dot, the bf16 x tile converted by inline PTX, int8 values too), besides the
    launch trigger every compiled kernel starts with (`common.program_id`)."""
    from pjinfer.benchmarks import kernel_ptx

    record = kernel_ptx.run(["--out", str(tmp_path / "r.json"), "--kind", "routed",
                             "--expert-dtype", dtype, "--tokens", "1"])
    assert record["block_sizes"]["block_k"] == 128 and record["ttir_ops"]["tt.dot"] >= 1
    assert record["ttir_ops"]["tt.elementwise_inline_asm"] == asm + 1


def test_kernel_ptx_reads_the_routed_ffn_down_kernel(tmp_path):
    """--kind routed_down: the routed FFN's second kernel, its activation's sigmoid the one
    inline assembly over bf16 experts besides the launch trigger."""
    from pjinfer.benchmarks import kernel_ptx

    record = kernel_ptx.run(["--out", str(tmp_path / "d.json"), "--kind", "routed_down",
                             "--tokens", "1"])
    assert record["ttir_ops"]["tt.elementwise_inline_asm"] == 2
    assert record["ttir_ops"]["tt.dot"] >= 1 and "arith.divf" not in record["ttir_ops"]


def test_sass_loop_is_the_longest_backward_branch():
    """cuobjdump lines: the loop is what lies between the longest backward branch and its
    target (a branch to itself, the kernel's trailing trap, is no loop)."""
    from pjinfer.benchmarks import kernel_ptx

    lines = ["        /*0000*/                   MOV R1, c[0x0][0x28] ;",
             "        /*0010*/                   IMAD.MOV.U32 R2, RZ, RZ, 0x1 ;",
             "        /*0020*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;",
             "        /*0030*/               @P0 BRA 0x10 ;",
             "        /*0040*/                   EXIT ;",
             "        /*0050*/                   BRA 0x50;"]
    loop = kernel_ptx.sass_loop("\n".join(lines))
    assert loop == lines[1:4]
    assert kernel_ptx.op_counts("\n".join(loop), kernel_ptx.SASS_OP) == {
        "IMAD": 1, "HMMA": 1, "BRA": 1}


def test_kernel_ptx_reads_the_decode_attention_kernel(tmp_path):
    """Over an fp8 cache the bf16 query's kernel widens each page to float16 (one convert
    per K and V load) and both dots take float16 operands."""
    from pjinfer.benchmarks import kernel_ptx

    record = kernel_ptx.run(["--out", str(tmp_path / "a.json"), "--kind", "decode_attention",
                             "--kv-dtype", "float8_e4m3fn", "--pages", "2"])
    assert record["block_sizes"]["pages_per_compute_block"] == 2
    assert record["ttir_ops"]["tt.dot"] == 2 and record["ttir_ops"]["tt.fp_to_fp"] == 2
    ttir, _, elements = kernel_ptx.attention_ttir("decode_attention", "float8_e4m3fn", 2)
    assert elements == 2 * 2 * 16 * 128
    assert "tensor<32x128xf8E4M3FN> -> tensor<32x128xf16>" in ttir
    # conversions come as unindented inline assembly: the loop mix counts them
    lines = "  mov.b32 %r1, %r2;\ncvt.rn.f16x2.e4m3x2 %r3, %rs1;\n@%p1 ld.global.b32 %r4, [%rd1];"
    assert kernel_ptx.op_counts(lines, kernel_ptx.LOOP_OP) == {"mov": 1, "cvt": 1, "ld": 1}


def test_kernel_ptx_reads_the_ragged_attention_kernel(tmp_path):
    from pjinfer.benchmarks import kernel_ptx

    record = kernel_ptx.run(["--out", str(tmp_path / "r.json"), "--kind", "ragged_attention",
                             "--kv-dtype", "float8_e4m3fn"])
    assert record["block_sizes"]["pages_per_compute_block"] == 2  # the kernel's default
    # K and V widened to float16, plus the masked V load's zero fill cast to e4m3
    assert record["ttir_ops"]["tt.dot"] == 2 and record["ttir_ops"]["tt.fp_to_fp"] == 3


def test_kernel_ptx_refuses_pages_triton_cannot_tile(tmp_path, capsys):
    from pjinfer.benchmarks import kernel_ptx

    with pytest.raises(SystemExit):
        kernel_ptx.run(["--out", str(tmp_path / "r.json"), "--kind", "ragged_attention",
                        "--pages", "3"])
    assert "--pages must be a power of two" in capsys.readouterr().err


def test_w8a8_compile_records_each_shape(tmp_path):
    from pjinfer.benchmarks import w8a8_compile

    out = tmp_path / "c.json"
    w8a8_compile.run(["--smoke", "--tokens", "8", "--calls", "1", "--out", str(out)])
    runs = json.loads(out.read_text())["runs"]
    assert [r["shape"] for r in runs] == [name for name, _, _ in w8a8_compile.SHAPES]
    assert all(r["compile_s"] > 0 and r["best_ms"] > 0 and r["tokens"] == 8 for r in runs)


@pytest.mark.parametrize("kind, warps", [("rotary_write", 4), ("moe_route", 1)])
def test_kernel_ptx_reads_the_per_token_kernels(tmp_path, kind, warps):
    """Qwen3's rotary write and routing kernels, one program a token: the routing's 8 passes
    are a max and an index min each, then the max of the 8 (the softmax's shift)."""
    from pjinfer.benchmarks import kernel_ptx

    record = kernel_ptx.run(["--out", str(tmp_path / "t.json"), "--kind", kind,
                             "--tokens", "8"])
    assert record["tiling"] == f"{warps} warps" and record["tokens"] == 8
    if kind == "moe_route":
        assert record["ttir_ops"]["arith.maxnumf"] == 8 + 1
        assert record["ttir_ops"]["arith.minsi"] >= 8
