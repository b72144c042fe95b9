#!/bin/bash
# Issue 24's run for one model, on a GPU: the uniform points and plans at three budgets
# (each in a fresh process), then each record's gradient against float32 at batch 8.
#   OUT=folder bash benchmarks/front.sh MODEL BATCH [IMAGE_SIZE]
# writes OUT/MODEL/records.json (and the plot), OUT/MODEL.log and OUT/MODEL-precision.json.
set -uo pipefail
model=$1 batch=$2 size=${3:-224}
export PYTHONUNBUFFERED=1
python3 -m jaxoffload bench --model "$model" --batch "$batch" --image-size "$size" \
  --dtype bfloat16 --steps 10 --strategies none,lean,remat,offload --budget 0.75,0.5,0.35 \
  --out "$OUT/$model" 2>&1 | tee "$OUT/$model.log"
python3 -m jaxoffload.bench.precision "$OUT/$model/records.json" --batch 8 \
  --out "$OUT/$model-precision.json" 2>&1 | tail -12
