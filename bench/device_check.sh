#!/usr/bin/env bash
# The GPU check, one call on a lent machine (issue 27, item 6; bench/device_check.py says what it runs):
#
#   bench/device_check.sh prepare      # HERE, once: wheels the GPU image lacks -> .devcheck/wheels
#   bench/device_check.sh [cuda|cpu]   # THERE: device conformance + one served greedy request
#
# The device machine reaches nothing outside it; its image has python3 (3.12) with a CUDA torch,
# transformers, tokenizers, safetensors, numpy, but not gguf or crc32c, which this package imports.
# `prepare` downloads those (py3.12 manylinux wheels) into .devcheck/wheels; add `.devcheck/` to
# .git/info/exclude and name it in the run's `carry`. The run installs them into /tmp (never into
# the image's environment), puts this checkout on PYTHONPATH and writes its results under $OUT
# (the device tool brings those back; commit them under bench/results/device-check-<date>/), or
# under bench/results/device-check-<date>/ when $OUT is unset. PYTHON picks the interpreter
# (default python3). Under 10 minutes: each step is bounded (--timeout, 240 s).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "${1:-}" = "prepare" ]; then
  mkdir -p .devcheck/wheels
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .devcheck/wheels gguf crc32c
  ls -l .devcheck/wheels
  exit 0
fi
DEVICE=${1:-cuda}
[ $# -gt 0 ] && shift
if compgen -G ".devcheck/wheels/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/devcheck-site .devcheck/wheels/*.whl
  export PYTHONPATH=/tmp/devcheck-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
RESULTS=${OUT:-bench/results/device-check-$(date -u +%Y-%m-%d)}
mkdir -p "$RESULTS"
uptime | tee "$RESULTS/uptime.txt"
exec "$PY" bench/device_check.py --device "$DEVICE" --out "$RESULTS" "$@"
