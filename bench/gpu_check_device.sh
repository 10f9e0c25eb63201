#!/usr/bin/env bash
# The device tool's command for the GPU check (docs/benchmarks.md, "Running the GPU check"):
#
#   bash bench/gpu_check_device.sh [gpu_check.py arguments]      # run: carry [".whl"], timeout_s 540
#
# On the GPU machine (no network): installs the carried wheels (bench/gpu_wheels.sh made them here) into
# /tmp/site, first on PYTHONPATH; installs dscompile from the tree (editable; the carried wheel where that cannot
# build); runs bench/gpu_check.py with its table, JSON, trace and log written to $OUT. Arguments pass through
# (`--only sparse --budget 200` to rerun a section). Without .whl/ it runs without DeepSpeed (its peers say so).
set -o pipefail
OUT=${OUT:?set by the device tool: where the files to bring back go}
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/site}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
if ! "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e .; then
    echo "editable install failed: installing the carried dscompile wheel" >&2
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/dscompile/*.whl || exit 1
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" -c "import dscompile, torch; print('dscompile from', dscompile.__file__, '| torch', torch.__version__)" || exit 1
PYTHONUNBUFFERED=1 timeout 500 "$PY" bench/gpu_check.py --out "$OUT/gpu_check.txt" "$@" 2>&1 | tee "$OUT/gpu_check.log"
