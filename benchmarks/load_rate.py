"""Checkpoint load rate against the disk's own read rate, measured in the same run.

    python -m pjinfer.benchmarks.load_rate configs/models/llama3-8b --dir /tmp/ckpt \\
        --output-json load_rate.json

Writes a real Hugging Face safetensors checkpoint of the config's shapes (names and shapes from
`transformers` on the meta device, random bf16 bytes, sharded like `save_pretrained`) unless
`--dir` already holds one, then per repeat: evict the files from the page cache, time a raw
parallel read of every file (the disk's rate: O_DIRECT where the filesystem allows it), evict
again, time `load_model` to params on the device. The ratio is load GB/s over read GB/s with a
cold page cache both times (eviction is `posix_fadvise(DONTNEED)` after `fsync`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import numpy as np

from pjinfer.weights import load_model

_CHUNK = 64 << 20  # bytes per read call


def hf_tensor_shapes(config_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Checkpoint names -> shapes as `save_pretrained` would write them (no weights allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    return shapes


def write_checkpoint(config_dir: str | Path, out_dir: Path, shard_bytes: int) -> int:
    """A sharded bf16 safetensors checkpoint with random bytes; returns its tensor bytes."""
    shapes = hf_tensor_shapes(config_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(config_dir) / "config.json", out_dir / "config.json")
    noise = np.random.default_rng(0).integers(0, 2**16, _CHUNK // 2, dtype=np.uint16)
    noise &= 0xBFFF  # bf16 bit patterns of |x| < 2: finite values
    shards, current, size = [], [], 0
    for name, shape in shapes.items():
        nbytes = int(np.prod(shape)) * 2
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((name, shape, nbytes))
        size += nbytes
    shards.append(current)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += _write_shard(out_dir / fname, shard, "BF16", noise.tobytes())
        weight_map.update({name: fname for name, _, _ in shard})
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total


def _write_shard(path: Path, tensors: list, st_dtype: str, noise: bytes) -> int:
    header, offset = {}, 0
    for name, shape, nbytes in tensors:
        header[name] = {"dtype": st_dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        left = offset
        while left:
            f.write(noise[:min(left, len(noise))])
            left -= min(left, len(noise))
        f.flush()
        os.fsync(f.fileno())
    return offset


def evict(files: list[Path]) -> None:
    """Drop the files' clean pages from the page cache (no root needed for one's own files)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _read_file(path: Path, direct: bool) -> int:
    """Every byte of `path` in large reads, into one reused (page-aligned) buffer."""
    import mmap

    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags)
    buf = mmap.mmap(-1, _CHUNK)  # page aligned, as O_DIRECT needs
    done = 0
    try:
        while n := os.readv(fd, [buf]):
            done += n
    finally:
        os.close(fd)
        buf.close()
    return done


def _direct_works(path: Path) -> bool:
    """O_DIRECT bypasses the page cache; tmpfs and some overlays refuse it."""
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        return False
    return True


def disk_read_seconds(files: list[Path], threads: int) -> tuple[float, bool]:
    """Seconds to read all files, one thread per file up to `threads`; O_DIRECT if it works."""
    direct = _direct_works(files[0])
    evict(files)
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda f: _read_file(f, direct), files))
    return time.perf_counter() - start, direct


def load_seconds(model_dir: Path) -> float:
    start = time.perf_counter()
    jax.block_until_ready(load_model(model_dir, dtype="bfloat16")[1])
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="folder with the config.json whose shapes to write")
    parser.add_argument("--dir", required=True, help="where the checkpoint is (or goes)")
    parser.add_argument("--shard-gb", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=8, help="readers for the disk rate")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    out = Path(args.dir)
    start = time.perf_counter()
    if not (out / "model.safetensors.index.json").is_file():
        write_checkpoint(args.config, out, int(args.shard_gb * 1e9))
    write_s = time.perf_counter() - start
    files = sorted(out.glob("*.safetensors"))
    nbytes = sum(f.stat().st_size for f in files)
    runs = []
    for _ in range(args.repeats):
        read_s, direct = disk_read_seconds(files, args.threads)
        evict(files)
        runs.append({"disk_read_s": read_s, "load_s": load_seconds(out)})
    best_read = min(r["disk_read_s"] for r in runs)
    best_load = min(r["load_s"] for r in runs)
    record = {
        "command": "load_rate", "config": args.config, "bytes": nbytes, "files": len(files),
        "device": jax.devices()[0].device_kind, "jax": jax.__version__, "write_s": write_s,
        "o_direct": direct, "reader_threads": args.threads, "runs": runs,
        "disk_read_gb_s": nbytes / best_read / 1e9, "load_gb_s": nbytes / best_load / 1e9,
        "load_over_disk": best_read / best_load,
    }
    print(f"{nbytes / 1e9:.2f} GB in {len(files)} files: disk {record['disk_read_gb_s']:.2f} "
          f"GB/s (O_DIRECT {direct}), load {record['load_gb_s']:.2f} GB/s "
          f"({record['load_over_disk']:.0%} of the disk)")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(record, indent=2) + "\n")
    return record


if __name__ == "__main__":
    main()
