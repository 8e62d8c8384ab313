"""Round 37: the int4 routed test's inputs (test_routed_kernels_on_int4_experts[True]) through
gate/up, silu x up and down in float64, once exact and once with x and the activation rounded
to TF32's 11 bits (row sums exact), as the GPU's float32 dots do. From the repository root:

    PYTHONPATH=. python benchmarks/results/round37/offline/tf32_emulation.py
"""

import jax.numpy as jnp
import numpy as np

from pjinfer.kernels.expert_stack import int4_values
from tests.kernels.test_grouped_matmul_quantized import _int4


def tf32(a):
    bits = np.asarray(a, np.float32).copy().view(np.uint32)
    bits += 0x1000
    bits &= np.uint32(0xFFFFE000)
    return bits.view(np.float32)


def unpack(q):
    return (np.asarray(int4_values(q.values, q.scales.shape[1]), np.float64),
            np.asarray(q.scales, np.float64), np.asarray(q.zeros, np.float64))


def layer(x, stack, e, emulate):
    v, s, z = stack[0][e], stack[1][e], stack[2][e]  # [N, K], [G, N], [G, N]
    span = v.shape[1] // s.shape[0]
    out = 0
    for g in range(s.shape[0]):
        ks = slice(g * span, (g + 1) * span)
        xg = tf32(x[ks]) if emulate else x[ks]
        out = out + (xg.astype(np.float64) @ v[:, ks].T - x[ks].sum() * z[g]) * s[g]
    return out


def main():
    rng = np.random.default_rng(13)  # the test's draws, in its order
    ids = np.argsort(rng.random((6, 9)), axis=1)[:, :3].astype(np.int32)
    ids[2, 0] = -1
    x = np.asarray(jnp.asarray(rng.normal(size=(6, 64)), jnp.float32))
    gu, _ = _int4(jnp.asarray(rng.normal(size=(9, 64, 64)) / 8, jnp.float32), 2, True, 1)
    dn, _ = _int4(jnp.asarray(rng.normal(size=(9, 32, 64)) / 6, jnp.float32), 1, True, 2)
    stacks = unpack(gu), unpack(dn)
    results = []
    for emulate in (False, True):
        rows = []
        for t in range(6):
            for e in ids[t]:
                if e < 0:
                    rows.append(np.zeros(64))
                    continue
                g, u = np.split(layer(x[t], stacks[0], e, emulate), 2)
                h = (g / (1 + np.exp(-g)) * u).astype(np.float32)
                rows.append(layer(h, stacks[1], e, emulate))
        results.append(np.array(rows))
    exact, emulated = results
    diff = np.abs(emulated - exact)
    print("max abs diff", diff.max(), "scale", np.abs(exact).max(),
          "over tol", int((diff > 5e-3 + 2e-2 * np.abs(exact)).sum()))


if __name__ == "__main__":
    main()
