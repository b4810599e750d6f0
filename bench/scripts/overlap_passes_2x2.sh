#!/usr/bin/env bash
# One 4-GPU device call, two 2-GPU lanes at once (the runs of one lane never share a GPU with the other's):
#   lane a, GPUs 0-1: DeepSeek V3 16B cut to 6 layers, dp_shard 2 x ep 2: ours full Inductor (first: the compile
#     failed there before), then, if it trained, ep_overlap and torchtitan compile;
#   lane b, GPUs 2-3: llama3 8B cut to 16 layers at tp 2, ours with (the default) and without async_tp; then, on GPU 2, the
#     cold start of llama3 70B as one rank of dp_shard 32 (fake communication).
# Usage (after the wheels line of ../shared/device/wheels.sh): bash bench/scripts/overlap_passes_2x2.sh OUT RUNS
set -u
out=$1 runs=$2
mkdir -p "$out/a" "$out/b" "$out/c" "$runs"
lane_a() {
  export CUDA_VISIBLE_DEVICES=0,1
  local g="DeepSeek 16B-6L dp2 ep2"
  python3 bench/run.py --suite multi --gpus 2 --groups "$g" --only "gt aot_fx_trace full" --steps 12 --timeout 180 \
    --out "$out/a" --runs-dir "$runs/a"
  if grep -q '"tokens_per_second"' "$out"/a/*-multi-2gpu.json; then
    python3 bench/run.py --suite multi --gpus 2 --groups "$g" --only "gt full ep_overlap,titan compile" --steps 12 \
      --timeout 180 --merge "$out"/a/*-multi-2gpu.json --out "$out/a" --runs-dir "$runs/a"
  fi
}
lane_b() {
  export CUDA_VISIBLE_DEVICES=2,3
  python3 bench/run.py --suite multi --gpus 2 --groups "8B-16L tp2" --only "gt aot_fx_trace full,gt full no async_tp" \
    --steps 12 --timeout 150 --out "$out/b" --runs-dir "$runs/b"
  CUDA_VISIBLE_DEVICES=2 python3 bench/run.py --suite scale --groups "70B dp32" --only "gt aot_fx_trace full" --steps 12 \
    --timeout 240 --out "$out/c" --runs-dir "$runs/c"
}
lane_a > "$runs/a.log" 2>&1 &
lane_b > "$runs/b.log" 2>&1 &
wait
