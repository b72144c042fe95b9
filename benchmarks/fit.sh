#!/bin/bash
# Issue 25's runs on a GPU, under a 16 GiB cap, each resumable across calls:
#   OUT=folder [FROM=earlier-folder] [STOP=S] [MIN_SPEED=share] \
#     bash benchmarks/fit.sh resnet50|unet|accum [TIME_LIMIT]
# resnet50: ResNet-50's largest batch under each strategy and the plan (--max-batch).
# unet: the U-Net's largest image side at batch 1 under Store, Remat and the plan.
# accum: the accumulation peers at the plan's largest ResNet-50 batch (read from
#   FROM/resnet50/records.json): grad-accum, micro-batches within Store's largest batch,
#   and grad-accum-lean, fewer and larger ones within Lean's.
# FROM holds an earlier call's folders; each run resumes from its own there. After STOP
# seconds the bench is interrupted, as by Ctrl-C, keeping what it measured. MIN_SPEED is
# the planned search's --min-speed (by default, none). Writes
# OUT/RUN.log and OUT/RUN.tgz (its folders: records.json and the plots).
set -uo pipefail
run=$1 limit=${2:-120}
export PYTHONUNBUFFERED=1
cap=(--dtype bfloat16 --steps 5 --memory-cap 16)
floor=(${MIN_SPEED:+--min-speed "$MIN_SPEED"})
bench=(timeout -s INT -k 30 "${STOP:-100000}" python3 -m jaxoffload bench)
work=$(mktemp -d)
resume() {  # the earlier call's folder, if any, to resume from
  if [ -n "${FROM:-}" ] && [ -d "$FROM/$1" ]; then cp -r "$FROM/$1" "$work/$1"; echo --resume; fi
}
case $run in
resnet50)
  "${bench[@]}" --model flax-resnet50 --batch 256 --image-size 224 "${cap[@]}" \
    --strategies none,lean,remat,offload --max-batch --time-limit "$limit" "${floor[@]}" \
    --out "$work/resnet50" $(resume resnet50) 2>&1 | tee -a "$OUT/resnet50.log"
  ;;
unet)
  "${bench[@]}" --model flax-unet --batch 1 --image-size 1024 "${cap[@]}" \
    --strategies none,remat --max-image-size --time-limit "$limit" "${floor[@]}" \
    --out "$work/unet" $(resume unet) 2>&1 | tee -a "$OUT/unet.log"
  ;;
accum)
  # The plan's largest batch B, split into k micro-batches each within 95% of the
  # strategy's own largest batch (a scan's step holds a little more), B rounded down to
  # a multiple of both splits.
  read -r batch store lean < <(python3 -c "
import json, math, sys
r = {x['strategy']: x for x in json.load(open('$FROM/resnet50/records.json'))}
B = r['plan']['max_batch']
k, k2 = (math.ceil(B / (0.95 * r[s]['max_batch'])) for s in ('none', 'lean'))
B -= B % math.lcm(k, k2)
print(B, B // k, B // k2)")
  echo "global batch $batch: micro-batches of $store (grad-accum), $lean (grad-accum-lean)"
  for peer in grad-accum:$store grad-accum-lean:$lean; do
    "${bench[@]}" --model flax-resnet50 --batch "$batch" --image-size 224 \
      "${cap[@]}" --strategies "${peer%:*}" --micro-batch "${peer#*:}" \
      --out "$work/${peer%:*}" 2>&1 | tee -a "$OUT/accum.log"
  done
  ;;
*) echo "usage: OUT=folder bash benchmarks/fit.sh resnet50|unet|accum [TIME_LIMIT]" >&2; exit 2 ;;
esac
tar -czf "$OUT/$run.tgz" --exclude='*.npz' -C "$work" .
