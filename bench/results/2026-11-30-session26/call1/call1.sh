# 2 x H200, real NCCL, bf16 storage: llama3 8B cut to 16 layers, dp_shard 2, 1 x 8192 a rank. The per-block schedule
# gathers each parameter outside the blocks alone (the final norm no longer holds the output projection's gathered
# bucket through the loss) and prefetches 1 block ahead unless a deeper prefetch saves 0.5% of the step: the memory
# policy with the fused loss at 40, 39 and 38.5 GiB beside torchtitan compile and our default; then the auto-placed
# runs (native and autoparallel_backend, which schedules per block since session 25) against the same call's manual run
O=$1
timeout 320 python bench/run.py --suite multi --gpus 2 --groups "8B-16L dp2" --only "titan compile,gt aot_fx_trace full,gt full memory_budget 40GiB fused loss,gt full memory_budget 39GiB fused loss,gt full memory_budget 38.5GiB fused loss" --steps 8 --timeout 100 --out $O/a --runs-dir /tmp/runs_s26c1 --bytecode-cache > $O/a.out 2>&1
timeout 240 python bench/run.py --suite multi --gpus 2 --groups "8B-16L dp2 auto" --only "gt full auto-placed,gt autoparallel_backend auto-placed" --steps 8 --timeout 110 --out $O/b --runs-dir /tmp/runs_s26c1 --bytecode-cache > $O/b.out 2>&1
cd /tmp && for f in runs_s26c1/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_s26c1/*/metrics.jsonl runs_s26c1/*/log.txt runs_s26c1/*/prediction.json runs_s26c1/*/placements.json 2>/dev/null)
cd $O && for x in a b; do grep -v "NCCL INFO" $x.out > $x.txt; rm -f $x.out; done; tar czf suites.tgz a b && rm -rf a b
