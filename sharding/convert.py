"""`pjinfer convert SRC_HF_DIR DST_DIR [--dtype bfloat16] [--tensor-parallel-size N]`.

Loads a Hugging Face folder (on a tp mesh when N > 1, so a model larger than one device converts)
and writes an orbax checkpoint plus the config and tokenizer files: DST_DIR is then a model folder
that `pjinfer.LLM(DST_DIR)` restores directly into its shards.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from pjinfer.config import DTYPES, ModelConfig, resolve_dtype

# Everything but the weights: config, generation config, tokenizer, chat template.
_COPY_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken", ".py")
_SKIP = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pjinfer convert",
                                description="Convert a Hugging Face model folder to orbax.")
    p.add_argument("src", help="local Hugging Face model folder (safetensors)")
    p.add_argument("dst", help="output folder (created; existing params are overwritten)")
    p.add_argument("--dtype", default="auto", choices=("auto", *DTYPES),
                   help="dtype to store (auto = the checkpoint's)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard over this many devices while converting")
    args = p.parse_args(argv)
    if not Path(args.src).is_dir():
        p.error(f"SRC_HF_DIR {args.src!r} is not a folder")
    if args.tensor_parallel_size < 1:
        p.error("--tensor-parallel-size must be >= 1")
    return args


def copy_model_files(src: Path, dst: Path) -> list[str]:
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for f in sorted(src.iterdir()):
        if f.is_file() and f.suffix in _COPY_SUFFIXES and f.name not in _SKIP:
            shutil.copy2(f, dst / f.name)
            copied.append(f.name)
    return copied


def convert(src: str | Path, dst: str | Path, *, dtype: str = "auto",
            tensor_parallel_size: int = 1) -> Path:
    """Load SRC (sharded when tp > 1), save params as orbax in DST, copy the other files."""
    from pjinfer.weights import load_params

    from .checkpoint import save_params
    from .mesh import make_mesh

    src, dst = Path(src), Path(dst)
    cfg = ModelConfig.from_pretrained(src)
    mesh = make_mesh(tensor_parallel_size, cfg=cfg) if tensor_parallel_size > 1 else None
    # canonical layout (kv heads not duplicated): the checkpoint serves any tp
    params = load_params(src, cfg, dtype=dtype, load_format="safetensors", mesh=mesh,
                         canonical=True)
    copy_model_files(src, dst)
    return save_params(params, dst, dtype=str(resolve_dtype(dtype, cfg)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    out = convert(args.src, args.dst, dtype=args.dtype,
                  tensor_parallel_size=args.tensor_parallel_size)
    print(f"wrote {out} in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
