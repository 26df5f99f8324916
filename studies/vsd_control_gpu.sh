#!/bin/bash
# The synthetic control (python -m mmvsd_studies.vsd_control) at 3 seeds x 8 arms on one CUDA GPU, one process per run.
#   [RUNS="0:ce-greedy 1:vsd ..."] [DEVICE=cuda] [PYTHON=python3] \
#       bash studies/vsd_control_gpu.sh SRC OUT [KEY=VALUE...]
# SRC holds what the CPU made once (the trained target-*, data-*.jsonl and the drafter-init-* of each seed), so
# every run starts from the same target, data and initial drafter as the CPU runs; each run gets its own working
# folder OUT/s<seed>-<arm> (its answers regenerated, its held-out set and lossless check made on the GPU).
set -u
src=${1:?SRC: the folder with the target, data and initial drafters}
out=${2:?OUT: the working folder}
shift 2
for run in ${RUNS:-$(for s in 0 1 2; do printf '%s ' $s:{ce-greedy,ce-sample,vsd,ce+vsd,accept,ce+accept,vsd-rloo,ce+vsd-rloo}; done)}; do
  seed=${run%%:*} arm=${run#*:}
  {
    dir="$out/s$seed-${arm//+/_}"  # no "+" in paths: `--data` reads "a+b" as two datasets
    mkdir -p "$dir" && cp -r "$src"/. "$dir"/
    # answers SRC/regenerated holds are reused: their cache key names the target's folder, now the run's
    for cache in "$dir"/regenerated/*.jsonl; do
      [ -f "$cache" ] && sed -i "s#\"target\": \"[^\"]*/target-#\"target\": \"$dir/target-#" "$cache"
    done
    ("${PYTHON:-python3}" -m mmvsd_studies.vsd_control --device "${DEVICE:-cuda}" --out "$dir" --arms "$arm" \
        --results "$dir/result.json" "arm_seed=$seed" "$@" > "$dir/log.txt" 2>&1
     echo "rc=$?" >> "$dir/log.txt") &
  }
done
wait
grep -H "^rc=" "$out"/*/log.txt
