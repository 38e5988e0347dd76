#!/usr/bin/env bash
# Run several jobs at once, each on its own GPUs of one host ("lanes").
#
#   benchmarks/run_lanes.sh PLAN OUT_DIR TIMEOUT_S
#
# PLAN: one lane per line, "GPUS ; COMMAND ; COMMAND ...", e.g.
#   0,1 ; python3 -m pytest tests/gpu -q
#   2,3 ; python3 benchmarks/ddp_bench.py --nproc 2 --model gpt-tiny --out OUT/gpt-tiny
# The commands of a lane run one after the other with CUDA_VISIBLE_DEVICES=GPUS; lanes run
# concurrently. "OUT" in a command is replaced by OUT_DIR. Each lane's output goes to
# OUT_DIR/lane<N>.log; every lane is killed after TIMEOUT_S seconds.
set -u
plan=$1; out=$2; limit=$3
mkdir -p "$out"
n=0
pids=()
while IFS= read -r line; do
  [[ -z "${line// }" || "$line" == \#* ]] && continue
  gpus=${line%%;*}; gpus=${gpus// /}
  cmds=${line#*;}
  cmds=${cmds//OUT/$out}
  log="$out/lane$n.log"
  echo "lane $n on GPUs $gpus: $cmds" | tee "$log"
  ( export CUDA_VISIBLE_DEVICES=$gpus; timeout -k 10 "$limit" bash -c "set -x; ${cmds//;/ ; }" >>"$log" 2>&1; echo "lane exit $?" >>"$log" ) &
  pids+=($!)
  n=$((n + 1))
done < "$plan"
for p in "${pids[@]}"; do wait "$p"; done
tail -n 3 "$out"/lane*.log
