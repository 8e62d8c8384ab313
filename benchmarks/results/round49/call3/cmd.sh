#!/usr/bin/env bash
# Session 51 calls 2-6: a Mosaic GPU int4 GEMV, as pjinfer/kernels/int4_gemv.py during the
# calls (not kept in the package; its last form is int4_gemv.py.txt beside this file: the
# same algorithm, called then as int4_gemv(x, packed, scales, zeros, group_rows=, tiling=),
# with a "noscale" timing probe since removed, and without the later `ctas` option, never
# run on a GPU); the probe script: int4_mosaic_probe.py.txt (in .scratch/ for the calls).
#   call 2: misaligned-address fault (x's per-block sums staged as 32-byte rows)
#   call 3: block_k 128 only (tilings st4 ks4, st6 ks2, st4 ks8), T = 1, 8, 16, three shapes
#   call 4: block_k 128 / 256 / 512 (tiling list in the JSON's names), T = 1, 8
#   call 5: the "noscale" probe (one accumulator, no per-group scaling), st8, ks8
set -u
export REPO=$(pwd) PY=python3
source benchmarks/device_env.sh
R=/tmp/r; mkdir -p $R
python3 .scratch/int4_mosaic_probe.py $R/int4_mosaic_check.json check
python3 .scratch/int4_mosaic_probe.py $R/int4_mosaic.json
