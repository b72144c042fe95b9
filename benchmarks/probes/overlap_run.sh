#!/usr/bin/env bash
# Runs overlap_probe.py's variants, each in its own process, in the order given, into $1; packs
# the results after every run, so that a call cut short still returns what it measured.
# Usage: bash benchmarks/probes/overlap_run.sh OUT "minimal" "lean @L" "plans/planL.json @L fdo=1" ...
# Each spec is a variant and its options; @L stands for the in-flight limit of 64. MODEL, BATCH
# and IMAGE in the environment reach the probe.
out=$1; shift
mkdir -p "$out/r"
L=xla_gpu_experimental_parallel_async_compute_limit=64
run=0
for spec in "$@"; do
  run=$((run + 1))
  set -- ${spec//@L/$L}
  echo "=== $spec $(date +%T)"
  if [ "$1" = minimal ]; then
    timeout 150 python benchmarks/probes/overlap_probe.py minimal "$out/r" 2>&1 | grep -v -i warning | cut -c1-900
    # Keep the small program's traces; the ResNet's are summarised in their JSON.
    for f in "$out"/r/trace-*_compute; do
      x=$(find "$f" -name '*.xplane.pb' | head -1); [ -n "$x" ] && cp "$x" "$out/r/$(basename "$f").xplane.pb"
    done
  else
    v=$1; shift
    env RUN=-$run ${PGLE:+PGLE=$PGLE} timeout 150 python benchmarks/probes/overlap_probe.py resnet50 "$v" "$out/r" "$@" 2>&1 | grep -v -i warning | cut -c1-900
  fi
  rm -rf "$out"/r/trace-*/
  (cd "$out/r" && tar czf ../results.tar.gz .)
done
rm -rf "$out/r"; ls -la "$out"
