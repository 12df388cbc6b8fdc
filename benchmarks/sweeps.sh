#!/usr/bin/env bash
# The simulated sweeps of benchmarks/results/sweep_* (the seed's protocol on the simulator), on any
# machine, CPU only: about 70 minutes on 2 cores, most of it the U-Net's sizes in slabs. The
# planner's searches are counted, not timed, so a rerun writes the same figures.
#
#   benchmarks/sweeps.sh                    # all of them
#   benchmarks/sweeps.sh resnet50 unet3d    # some: resnet50 resnet50_free_held googlenet
#                                           # deeplabv3 unet3d unet3d_free_held
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
out=${LMS_RESULTS:-benchmarks/results}
models=${*:-resnet50 resnet50_free_held googlenet deeplabv3 unet3d unet3d_free_held}

sweep() {  # model, spec name, file suffix, extra args
  $PY -m lms -q sweep --model "$1" --gpu-memory 32GiB --device-spec "$2" \
    --json "$out/sweep_$1_$3.json" --plot "$out/sweep_$1_$3.png" "${@:4}"
}

for model in $models; do
  case $model in
    resnet50)
      sweep resnet50 v100-32gb v100-32gb --step 500
      sweep resnet50 h100 h100-pcie5-32gb --step 500 ;;
    resnet50_free_held)  # plans that empty what the step's code holds (the batch, layer1's input)
      sweep resnet50 v100-32gb v100-32gb_free_held --step 500 --free-held ;;
    googlenet) sweep googlenet v100-32gb v100-32gb --step 500 ;;
    deeplabv3) sweep deeplabv3 v100-32gb v100-32gb --step 100 --batch-size 16 ;;
    unet3d)
      sweep unet3d v100-32gb v100-32gb --step 16 --start 64
      sweep unet3d h100 h100-pcie5-32gb --step 16 --start 64 ;;
    unet3d_free_held)  # the encoder outputs the U-Net's code holds, emptied; it finds its start
      sweep unet3d v100-32gb v100-32gb_free_held --step 16 --free-held ;;
    *) echo "unknown model $model" >&2; exit 2 ;;
  esac
done
echo "results in $out"
