#!/usr/bin/env bash
# Wheels for the GPU machine (no network there), into .whl/ at the repository root (ignored by git; carried by
# the device tool's `carry: [".whl"]`). Run here, where pip reaches PyPI, before each GPU check:
#
#   bash bench/gpu_wheels.sh            # in the project's venv (DeepSpeed's build imports torch); PYTHON=... picks another
#
# - DeepSpeed 0.19.8: pure Python (its CUDA ops are JIT-built where they run), built here as a py3 wheel; and
#   the packages it needs that the GPU image lacks (its list: /work/.library/device/KINDS.md): hjson, pydantic,
#   pydantic-core (a CPython 3.12 manylinux wheel: the image's Python), annotated-types, typing-inspection,
#   typing-extensions (pydantic needs a newer one than some images hold). Installed there with --target into
#   /tmp/site, which PYTHONPATH puts first.
# - dscompile itself from this working tree, into .whl/dscompile/ (apart, so `.whl/*.whl` leaves it out): the
#   fallback when `pip install -e .` cannot build there. Rebuilt on every run, so it is the tree being carried.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PY=${PYTHON:-python3}
rm -rf .whl && mkdir -p .whl/dscompile
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl \
    hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl/dscompile .
rm -rf build
ls -la .whl .whl/dscompile
du -sh .whl
