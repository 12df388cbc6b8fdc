#!/usr/bin/env bash
# What a GPU machine runs (under 10 minutes): the link probe, then the seed's sweeps measured with
# the card limited to 32 GiB as the seed's V100 (fp32 and bf16 autocast), LMS beside no offload,
# save_on_cpu and activation checkpointing, and the simulator's predictions for the same sizes.
# Results go to benchmarks/results/gpu-<card>/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
card=$($PY -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '-'))")
out=benchmarks/results/gpu-$card
mkdir -p "$out"
$PY -c "
import json, torch
from lms.tuning import measure_link_gbps
d2h, h2d = measure_link_gbps(torch.device('cuda'))
info = {'gpu': torch.cuda.get_device_name(0), 'torch': torch.__version__,
        'd2h_gbps': d2h, 'h2d_gbps': h2d}
print(info); json.dump(info, open('$out/link.json', 'w'), indent=2)
"
run() {  # name, model, sizes, extra args
  timeout 170 $PY -m lms -q bench --model "$2" --sizes "$3" --budget 32GiB --steps 3 \
    --json "$out/bench_$1.json" --plot "$out/bench_$1.png" "${@:4}" || echo "bench $1 stopped"
}
run resnet50 resnet50 2000,4000,6000,8000,10000
run resnet50_amp resnet50 4000,6000,8000,10000 --amp
run unet3d unet3d 128,192,240,288,336
run deeplabv3 deeplabv3 500,800,1100,1400 --batch-size 2
for model in resnet50:6000 unet3d:240 deeplabv3:800; do
  $PY -m lms -q analyze --model "${model%%:*}" --image-size "${model##*:}" \
    --gpu-memory 32GiB --device-spec h100 --json "$out/analyze_${model%%:*}.json"
done
echo "results in $out"
