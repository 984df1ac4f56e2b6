#!/usr/bin/env bash
# bench.e2e's 16-node rows pinned to the first N CPUs, for each N given: how the rate scales with cores.
#   bench/cores.sh OUTDIR N... [-- bench.e2e options]
# Writes OUTDIR/e2e_<N>cores.json and .log per N (bench.e2e prints the cores it was pinned to).
set -uo pipefail
out=$1; shift; mkdir -p "$out"
counts=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do counts+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
for n in "${counts[@]}"; do
    taskset -c "0-$((n - 1))" python -m bench.e2e "$@" --json "$out/e2e_${n}cores.json" > "$out/e2e_${n}cores.log" 2>&1
    echo "$n cores: rc $?"; tail -n 12 "$out/e2e_${n}cores.log" | grep -E '^\| (gpuorch|split)'
done
