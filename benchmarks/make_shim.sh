#!/usr/bin/env bash
# Make the repository importable as `pjinfer` without installing it (no pip, no network):
# SHIM/pjinfer is a folder of symlinks to ./pjinfer/*, plus kernels, sharding, server and
# benchmarks under the names setuptools' package-dir mapping gives them (pjinfer.kernels, ...).
# Usage: source <(bash benchmarks/make_shim.sh [REPO] [SHIM])   # prints the export line
set -euo pipefail
repo=$(cd "${1:-.}" && pwd)
shim=${2:-/tmp/pjinfer-shim}
rm -rf "$shim/pjinfer"
mkdir -p "$shim/pjinfer"
for entry in "$repo"/pjinfer/*; do
  ln -s "$entry" "$shim/pjinfer/$(basename "$entry")"
done
for sub in kernels sharding server benchmarks; do
  [ -d "$repo/$sub" ] && ln -s "$repo/$sub" "$shim/pjinfer/$sub"
done
echo "export PYTHONPATH=$shim\${PYTHONPATH:+:\$PYTHONPATH}"
