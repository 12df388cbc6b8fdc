#!/usr/bin/env bash
# One call on a lent card, in order: the step records of the seed's cases (gpu.sh truth, at most
# TRUTH_S seconds), then the GPU tests. What comes back under $OUT: the six records,
# summary.json and log.txt (both runs' output): eight files at most.
#
#   OUT=/tmp/out bash benchmarks/gpu_session.sh
#
# Packages the card's image lacks (MONAI, for the 3D U-Net) travel as wheels in .whl/.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:?set OUT to the folder that comes back}
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__)"
  LMS_RESULTS=$out TRUTH_S=${TRUTH_S:-300} bash benchmarks/gpu.sh truth
  timeout "${TESTS_S:-200}" python3 -m pytest tests/gpu -q -p no:cacheprovider
} > "$out/log.txt" 2>&1
tail -60 "$out/log.txt"
