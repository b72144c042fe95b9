#!/usr/bin/env bash
# Runs overlap_probe.py's variants, each in its own process, into $1; then packs the results.
# Usage: bash benchmarks/probes/overlap_run.sh OUT "minimal" "lean" "off40 xla_gpu_...=64" ...
out=$1; shift
mkdir -p "$out/r"
run=0
for spec in "$@"; do
  run=$((run + 1))
  set -- $spec
  echo "=== $spec $(date +%T)"
  if [ "$1" = minimal ]; then
    timeout 150 python benchmarks/probes/overlap_probe.py minimal "$out/r" 2>&1 | grep -v -i warning | cut -c1-900
  else
    v=$1; shift
    env RUN=-$run ${PGLE:+PGLE=$PGLE} timeout 150 python benchmarks/probes/overlap_probe.py resnet50 "$v" "$out/r" "$@" 2>&1 | grep -v -i warning | cut -c1-900
  fi
done
# Keep the small program's traces; the ResNet's are summarised in their JSON.
for f in "$out"/r/trace-*_compute; do
  x=$(find "$f" -name '*.xplane.pb' | head -1); [ -n "$x" ] && cp "$x" "$out/r/$(basename "$f").xplane.pb"
done
rm -rf "$out"/r/trace-*/
(cd "$out/r" && tar czf ../results.tar.gz .) && rm -rf "$out/r"; ls -la "$out"
