#!/usr/bin/env bash
# What a GPU machine runs (about 10 minutes): the link probe, then the seed's sweeps measured with
# the card limited to 32 GiB as the seed's V100 (fp32 and bf16 autocast), LMS beside no offload,
# save_on_cpu and activation checkpointing, and the simulator's predictions for the same sizes
# (priced at the rates the card is measured to reach).
#
#   benchmarks/gpu.sh                 # everything
#   benchmarks/gpu.sh link resnet50   # some parts: link pinning resnet50 resnet50_amp unet3d
#                                     # deeplabv3 analyze resnet50_4x resnet50_10x resnet50_9x
#                                     # peak_blocks (the last four not in "everything": 3, 8, 8
#                                     # minutes and 30 s)
#   benchmarks/gpu.sh truth           # step records of the seed's cases, each replayed beside
#                                     # what it measured (benchmarks/truth.py; at most 6 minutes,
#                                     # 7 files: a record each and summary.json;
#                                     # TRUTH_ONLY=name,name for some cases)
#   benchmarks/gpu.sh headline        # the seed's ResNet50 figures first, for a short lease
#                                     # (about 6 minutes): 12650 px with free_held (10x), then
#                                     # the 4x sweep, save_on_cpu beside LMS
#   SIZES=4000,8000 benchmarks/gpu.sh resnet50   # other sizes for the sweeps named
#
# Results go to $LMS_RESULTS (default benchmarks/results/gpu-<card>/). Each sweep stops starting
# runs after its time limit and keeps its partial JSON.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The same allocator setting for every method: fewer fragmentation failures near the limit.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
card=$($PY -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '-'))")
out=${LMS_RESULTS:-benchmarks/results/gpu-$card}
mkdir -p "$out"
parts=${*:-link pinning resnet50 resnet50_amp unet3d deeplabv3 analyze}

sweep() {  # name, model, sizes, seconds, extra args (a run is stopped after half the seconds)
  $PY -m lms -q bench --model "$2" --sizes "${SIZES:-$3}" --budget 32GiB --steps 3 \
    --time-limit "$4" --run-timeout $(($4 / 2)) \
    --json "$out/bench_$1.json" --plot "$out/bench_$1.png" "${@:5}" || echo "bench $1 stopped"
}

train_32gb() {  # name, size, extra args: two steps of `lms train` on the card capped at 32 GiB,
  # with the allocator's history of the steps (a failed one too) for pytorch.org/memory_viz
  $PY -c "
import sys, torch
from lms.cli import main
torch.cuda.set_per_process_memory_fraction(32 * 2**30 / torch.cuda.get_device_properties(0).total_memory)
sys.exit(main(sys.argv[1:]))
" train --model resnet50 --image-size "$2" --steps 2 --budget 32GiB --host-budget 110GiB \
    --json "$out/train_$1.json" --memory-snapshot "$out/train_$1.pickle" "${@:3}" \
    > "$out/train_$1.log" 2>&1 || echo "train $1 stopped"
}

for part in $parts; do
  case $part in
    link) $PY -c "
import json, torch
from lms.orchestration.rates import measure_link_gbps
d2h, h2d = measure_link_gbps(torch.device('cuda'))
info = {'gpu': torch.cuda.get_device_name(0), 'torch': torch.__version__,
        'd2h_gbps': d2h, 'h2d_gbps': h2d}
print(info); json.dump(info, open('$out/link.json', 'w'), indent=2)
" ;;
    # PyTorch's pinned buffers against the pool's, at ResNet50's sizes at 12650 px (under a minute)
    pinning) $PY benchmarks/pinning.py --json "$out/pinning.json" ;;
    # Each run costs about 25 s beyond its steps (a fresh process, the trace, the tuning), so
    # each sweep starts next to the largest size without offload measured on an H100 at 32 GiB.
    resnet50) sweep resnet50 resnet50 4000,4500,8000,10000 240 ;;
    # The seed's slowdown at 4x: no offload at 4000 px (the largest that fits 32 GiB) against
    # LMS at 4000 and 8000 px, in one JSON (about 3 minutes).
    resnet50_4x) sweep resnet50_4x resnet50 4000,8000 240 --methods none,lms ;;
    resnet50_amp) sweep resnet50_amp resnet50 6000,6500,8000 150 --amp ;;
    unet3d) sweep unet3d unet3d 240,256,288 150 ;;
    deeplabv3) sweep deeplabv3 deeplabv3 1100,1400,2000 120 --batch-size 2 ;;
    # The seed's 10x: ResNet50 at 12650 px (10x the pixels of 4000) with free_held, which
    # empties the batch and layer1's input once forward no longer reads them (without it the
    # planner's largest fit in 32 GiB is 12000 px, 9x: part resnet50_9x). Two steps, the card
    # capped at 32 GiB, offloaded data held in up to 110 GiB of the host's 128 (the rest
    # spills). The stem's output has 2.56e9 elements, past 2^31: PyTorch picks cuDNN for it
    # (from cuDNN 9.3 on); SIZES=11500 keeps every tensor under 2^31.
    resnet50_10x) train_32gb resnet50_10x "${SIZES:-12650}" --free-held ;;
    resnet50_9x) train_32gb resnet50_9x "${SIZES:-12000}" ;;
    # The blocks live at the peak of tests/gpu's 5% check, beside its simulated tensor peak
    peak_blocks) $PY benchmarks/peak_blocks.py --json "$out/peak_blocks.json" ;;
    truth) $PY benchmarks/truth.py --out "$out" --time-limit "${TRUTH_S:-330}" \
      ${TRUTH_ONLY:+--only "$TRUTH_ONLY"} || echo "truth: some cases failed" ;;
    headline)
      train_32gb resnet50_10x "${SIZES:-12650}" --free-held
      sweep resnet50_4x resnet50 4000,8000 300 --methods none,lms,save_on_cpu ;;
    analyze)
      for model in resnet50:8000 unet3d:288 deeplabv3:1400; do
        $PY -m lms -q analyze --model "${model%%:*}" --image-size "${model##*:}" \
          --gpu-memory 32GiB --device-spec local --json "$out/analyze_${model%%:*}.json"
      done ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
echo "results in $out"
