#!/bin/bash
# Ad hoc: lanes on one replica (one engine thread, a core left for the front end), bulk_max_drain_s
# 0.05 / 0.02 / 0.015, 3 cycles with the start rotated, 2 lanes_bench repeats per round.
cd /work/main; source .venv/bin/activate
set -- 0.05 0.02 0.015
for cycle in 1 2 3; do
  for d in "$@"; do
    embedfleet up --detach --config benchmarks/results/lanes-2026-12-05-one-engine/one-$d.yaml > ${OUT:-/tmp}/fr-up-$d-$cycle.log 2>&1
    python -m embedfleet.benchmarks.lanes_bench --model all-minilm-l6-v2 --repeats 2 --seconds 20 --out ${OUT:-/tmp}/fr-$d-$cycle.json > ${OUT:-/tmp}/fr-$d-$cycle.log 2>&1
    echo "cycle $cycle drain $d $(date +%T)"
  done
  set -- "${@:2}" "$1"
done
echo finished
