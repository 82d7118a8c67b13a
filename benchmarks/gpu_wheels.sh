#!/usr/bin/env bash
# The wheels the GPU machines' image lacks for the GPU suite (benchmarks/gpu_suite.py), for its
# Python 3.12, at constraints.txt's versions, into .whl/ (git-ignored). Run here, before a GPU
# session; the device command then installs them (docs/benchmarks.md, "What a GPU session does").
# The image has jax (with its CUDA plugin), flax, optax, orbax, tensorstore, jaxtyping and the
# rest of what the step imports (/work/.library/device/KINDS.md lists it).
set -euo pipefail
cd "$(dirname "$0")/.."
packages=(ml_collections einshape immutabledict pydantic pydantic_core annotated-types
  typing-inspection qwix typeguard)
# Not constraints.txt's tokamax (0.0.12, for the CPU suite's jax 0.10.2): the image's jax 0.11.2
# renamed Mosaic GPU's kernel arguments, which tokamax follows from 0.0.15 on (0.0.17 needs jax
# >= 0.11.1). tokamax imports xprof at start (its benchmarking module), and xprof's command-line
# module needs fire, termcolor and gviz_api; the image has xprof's other imports.
gpu_only=(tokamax==0.0.17 xprof==2.24.2 fire==0.7.1 termcolor==3.3.0 gviz-api==1.10.0)
pins=()
for name in "${packages[@]}"; do
  pin=$(grep -i -E "^${name//[-_]/[-_]}==" constraints.txt) || {
    echo "error: $name is not pinned in constraints.txt" >&2
    exit 2
  }
  pins+=("$pin")
done
rm -rf .whl && mkdir .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${pins[@]}" \
  "${gpu_only[@]}"
du -sh .whl
