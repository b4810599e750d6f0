# One H200 of 2: Inductor's compile of the largest in-graph update (update_compile.py). Then 2 x H200, real NCCL:
# llama3 8B cut to 16 layers, dp_shard 2, 1 x 8192 a rank: the fused-loss step with and without the in-graph optimizer
# at 39.5 GiB and with it at 39 GiB beside torchtitan compile; llama3 1B dp_shard 2, 2 x 4096 a rank: our default with
# and without the in-graph optimizer beside torchtitan compile.
O=$1
timeout 120 python bench/results/2026-11-30-session28/call3/update_compile.py > $O/update_compile.txt 2>&1
timeout 250 python bench/run.py --suite multi --gpus 2 --groups "8B-16L dp2" --only "titan compile,gt full memory_budget 39.5GiB fused loss,gt full memory_budget 39.5GiB fused loss optimizer_in_graph,gt full memory_budget 39GiB fused loss optimizer_in_graph" --steps 8 --timeout 100 --out $O/a --runs-dir /tmp/runs_s28c3a --bytecode-cache > $O/a.out 2>&1
timeout 160 python bench/run.py --suite multi --gpus 2 --groups "1B dp2" --only "titan compile,gt aot_fx_trace full,gt full optimizer_in_graph" --steps 8 --timeout 100 --out $O/b --runs-dir /tmp/runs_s28c3b --bytecode-cache > $O/b.out 2>&1
cd /tmp && for f in runs_s28c3?/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_s28c3?/*/metrics.jsonl runs_s28c3?/*/log.txt runs_s28c3?/*/prediction.json 2>/dev/null)
cd $O && for x in a b; do grep -v "NCCL INFO" $x.out > $x.txt; rm -f $x.out; done; tar czf suites.tgz a b && rm -rf a b
