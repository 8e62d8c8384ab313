"""When XLA re-records a step's command buffers (CUDA graphs), and what that costs the host.

    python -m pjinfer.benchmarks.command_buffer_updates --out cmdbuf.json         # H200
    python -m pjinfer.benchmarks.command_buffer_updates --smoke --out /tmp/c.json  # CPU plumbing

XLA replays a jitted step's kernels as command buffers and, before each replay, updates the
recorded commands whose buffers moved since the last call. On the H200 a Llama-3-8B decode
step's ~490-command buffer was re-recorded before every call, 0.8-1.35 ms of the launching
thread's time (RESULTS.md, "Round 6"). A chain of `--layers` matmul layers with a donated
state (as the KV cache is) is called here in the ways an engine can call its step:

- `state_only`: the same input every call, the donated state the only output;
- `new_input`: a new device copy of the input every call;
- `fresh_output`: the step also returns a fresh array (as the logits are);
- `donated_output`: that output written over a buffer donated back each call, which a second
  executable reads after each step (as the sampler reads the logits);
- `donated_output_x2`: the same with two such buffers taken in turn, so a step never donates
  the buffer the reader of the step just before still has queued.

Per case: the host's microseconds to issue a call, microseconds per call until all are done
(`--calls` back to back), and, from XLA's log (the cases run in a child process with
TF_CPP_VMODULE=command_buffer_thunk=3), the updates and the microseconds they took.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

from pjinfer.benchmarks.common import (
    finish_record,
    jax_device_info,
    new_record,
    positive_int,
    print_table,
)

CASES = ("state_only", "new_input", "fresh_output", "donated_output", "donated_output_x2")
_UPDATED = re.compile(r"Updated command buffer in (\d+)")


def _steps(layers: int, width: int):
    """(step, step also returning h, step writing h over a donated buffer, reader of h):
    jitted, the state [8, width] f32 donated."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(0), layers)
    weights = [jax.random.normal(k, (width, width), jnp.bfloat16) * 0.02 for k in keys]

    def body(state, x):
        h = state[x % 8]  # [16, width]
        for w in weights:
            h = jnp.tanh(h.astype(jnp.bfloat16) @ w).astype(jnp.float32)
        return state.at[x % 8].add(h), h

    step = jax.jit(lambda s, x: body(s, x)[0], donate_argnums=0)
    with_h = jax.jit(body, donate_argnums=0)
    into = jax.jit(lambda s, x, out: (lambda r: (r[0], out.at[:].set(r[1])))(body(s, x)),
                   donate_argnums=(0, 2))
    reader = jax.jit(lambda h: h.sum())
    return step, with_h, into, reader


def _case(name: str, fns, width: int, calls: int) -> None:
    """Time `calls` calls of one case and print the timings between two markers on stderr,
    where they bracket XLA's log lines of the case (`parse_log` reads them back)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    step, with_h, into, reader = fns
    x = jnp.arange(16, dtype=jnp.int32)
    bufs = [jnp.zeros((16, width), jnp.float32) for _ in range(2)]
    keep = []  # outputs a reader still holds, as the engine holds its in-flight steps

    def call(state, i):
        if name == "state_only":
            return step(state, x)
        if name == "new_input":
            return step(state, jax.device_put(np.arange(16, dtype=np.int32) + i))
        if name == "fresh_output":
            state, h = with_h(state, x)
        else:
            slot = 0 if name == "donated_output" else i % 2
            state, h = into(state, x, bufs[slot])
            bufs[slot] = h
        keep[:] = [*keep[-2:], reader(h)]
        return state

    state = jnp.zeros((8, width), jnp.float32)
    for i in range(3):  # compile, record
        state = call(state, i)
    jax.block_until_ready((state, keep))
    print(f"CASE_BEGIN {name}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    for i in range(calls):
        state = call(state, i)
    issued = time.perf_counter() - start
    jax.block_until_ready((state, keep))
    done = time.perf_counter() - start
    result = {"issue_us": issued / calls * 1e6, "pipelined_us": done / calls * 1e6}
    print(f"CASE_END {name} {json.dumps(result)}", file=sys.stderr, flush=True)


def parse_log(text: str) -> dict[str, dict]:
    """Per case: its timings and the command-buffer updates logged between its markers."""
    out, current, updates = {}, None, []
    for line in text.splitlines():
        if line.startswith("CASE_BEGIN "):
            current, updates = line.split()[1], []
        elif line.startswith("CASE_END ") and current is not None:
            _, name, payload = line.split(" ", 2)
            out[name] = {**json.loads(payload), "updates": len(updates),
                         "update_us": sum(updates)}
            current = None
        elif current is not None and (m := _UPDATED.search(line)):
            updates.append(int(m.group(1)))
    return out


def _child(args) -> None:
    fns = _steps(args.layers, args.width)
    for name in args.cases:
        _case(name, fns, args.width, args.calls)


def run_logged(argv: list[str]) -> dict[str, dict]:
    """The cases in a child process with XLA's command-buffer log on; parsed per case."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "0",
           "TF_CPP_VMODULE": "command_buffer_thunk=3"}
    proc = subprocess.run([sys.executable, "-m", __spec__.name, "--child", *argv], env=env,
                          capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"the benchmark's child process failed:\n{proc.stderr[-3000:]}")
    return parse_log(proc.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="pjinfer.benchmarks.command_buffer_updates",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    p.add_argument("--layers", type=positive_int, default=16)
    p.add_argument("--width", type=positive_int, default=2048)
    p.add_argument("--calls", type=positive_int, default=20)
    p.add_argument("--smoke", action="store_true", help="2 layers of 128, 3 calls (CPU)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="JSON result path")
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.width, args.calls = 2, 128, 3
    if args.child:
        _child(args)
        return 0
    record = new_record("command_buffer_updates", argv, vars(args))
    record["device"] = jax_device_info()
    child_argv = ["--cases", *args.cases, "--layers", str(args.layers), "--width",
                  str(args.width), "--calls", str(args.calls)]
    record["results"] = res = run_logged(child_argv)
    finish_record(record, args.out)
    print_table("Per call: host issue us / pipelined us / updates (their us)",
                [(name, f"{r['issue_us']:.0f} / {r['pipelined_us']:.0f} / {r['updates']} "
                        f"({r['update_us']})") for name, r in res.items()])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
