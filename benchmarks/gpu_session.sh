#!/usr/bin/env bash
# What a lent card runs, in calls that fit one lease (15 minutes of device time; a call starts
# in about 35 s, and the next finds the card warm if it follows at once), most wanted first so
# that a call stopped at its limit loses the least:
#
#   OUT=$OUT bash benchmarks/gpu_session.sh plain truth        # about 450 s: timeout_s 520
#   OUT=$OUT bash benchmarks/gpu_session.sh room gpt2 tests    # about 340 s: what is left
#   OUT=$OUT bash benchmarks/gpu_session.sh peers blocks       # the next lease: about 250 s
#
# plain: an unrecorded ResNet50 step to set the records' cost against; truth: the step records
# of the seed's cases (gpu.sh truth, at most TRUTH_S seconds; ResNet50 at 12650 px last, the 3D
# U-Net at 368^3 left out: no plan of it has fitted 32 GiB); gpt2: GPT-2 medium under LMS
# unrecorded, at 60% and at 76% of its simulated peak (24% less memory, where torchtune's
# offload is reported under 1% slower); tests: pytest tests/gpu; room: ResNet50 at 8000 px
# unrecorded under the 32 GiB cap, planned for 32 GiB (the seed's 4x, beside no offload at 4000
# px) and for 30 GiB (whether the caching allocator still frees its cache and retries, which
# lms_stats counts, with 2 GiB of room); peers: GPT-2 medium without offload, with Hugging Face's
# gradient checkpointing, save_on_cpu and torch.compile's memory budget (PEERS picks them);
# blocks: the allocator blocks live at the peak of the GPU tests' 5% check (gpu.sh
# peak_blocks). What comes back under $OUT: the records and peak_blocks.json, and log.txt, which
# holds everything printed and the truth's summary.json.
#
# Packages the card's image lacks travel as wheels in .whl/: platformdirs (a dependency of lms;
# without it every tune fails) and MONAI (the 3D U-Net).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:?set OUT to the folder that comes back}
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
lms=(env "PYTHONPATH=$PWD:${PYTHONPATH:-}" python3 -m lms)  # under timeout, as a command
capped() {  # seconds, then lms's arguments: run with the card capped at 32 GiB, as the seed's V100
  timeout "$1" env "PYTHONPATH=$PWD:${PYTHONPATH:-}" python3 -c "import sys, torch
from lms.cli import main
torch.cuda.set_per_process_memory_fraction(32 * 2**30 / torch.cuda.get_device_properties(0).total_memory)
sys.exit(main(sys.argv[1:]))" "${@:2}"
}
said() {  # the figures of a `lms train --json` file
  python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print({k: d.get(k) for k in
    ('model', 'method', 'size', 'batch_size', 'step_s', 'peak_bytes', 'lms_stats', 'plan')})" "$1"
}
parts=" ${*:-plain truth room gpt2 tests peers blocks} "
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__)"
  if [[ $parts == *" plain "* ]]; then
    echo "== the recorder's cost: ResNet50 at 4000 px without offload, unrecorded (the truth's"
    echo "== first case records the same step)"
    timeout 60 "${lms[@]}" -q train --model resnet50 --image-size 4000 --no-lms --steps 3 \
      --json /tmp/plain.json && said /tmp/plain.json
  fi
  if [[ $parts == *" truth "* ]]; then
    LMS_RESULTS=$out TRUTH_S=${TRUTH_S:-420} timeout "$((${TRUTH_S:-420} + 40))" \
      env TRUTH_ONLY="${TRUTH_ONLY:-resnet50_4000_none,resnet50_4000_lms,resnet50_8000_lms,unet3d_256_lms,gpt2_1024_lms,resnet50_12650_lms}" \
      bash benchmarks/gpu.sh truth
    echo "== summary.json"
    cat "$out/summary.json" && rm "$out/summary.json"
  fi
  if [[ $parts == *" room "* ]]; then
    for budget in 32GiB 30GiB; do
      echo "== ResNet50 at 8000 px under the 32 GiB cap, planned for $budget, unrecorded"
      capped 100 -q train --model resnet50 --image-size 8000 --budget "$budget" --steps 3 \
        --json /tmp/room.json && said /tmp/room.json
    done
  fi
  if [[ $parts == *" gpt2 "* ]]; then
    for share in 60 76; do
      echo "== GPT-2 medium under LMS at $share% of its simulated peak, unrecorded"
      timeout 80 "${lms[@]}" -q train --model gpt2 --seq-len 1024 --batch-size 12 \
        --budget "$share%" --steps 3 --json /tmp/gpt2.json && said /tmp/gpt2.json
    done
  fi
  if [[ $parts == *" tests "* ]]; then
    echo "== pytest tests/gpu"
    timeout "${TESTS_S:-150}" python3 -m pytest tests/gpu -q -rf -p no:cacheprovider --durations=8
  fi
  if [[ $parts == *" peers "* ]]; then
    echo "== GPT-2 medium peers"
    timeout "${PEERS_S:-220}" "${lms[@]}" -q bench --model gpt2 --sizes 1024 --batch-size 12 \
      --methods "${PEERS:-none,hf_checkpoint,save_on_cpu,compile_budget}" --steps 3 \
      --time-limit "$((${PEERS_S:-220} - 30))" --json /tmp/peers.json
    cat /tmp/peers.json  # not --json /dev/stdout: opening it for writing would empty this log
  fi
  if [[ $parts == *" blocks "* ]]; then
    echo "== the allocator's blocks at the 5% check's peak"
    LMS_RESULTS=$out timeout "${BLOCKS_S:-60}" bash benchmarks/gpu.sh peak_blocks
  fi
} > "$out/log.txt" 2>&1
tail -80 "$out/log.txt"
