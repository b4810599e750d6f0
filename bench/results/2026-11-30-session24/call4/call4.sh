# 2 x H200, real NCCL, bf16 storage: the solver prices a parameter's collectives as overlapped only over the
# data-parallel dims (over tp in series, as before: call 3's tp 2 plan that gathered the weights over the tp ranks ran
# at 0.83x our manual step). a: llama3 8B cut to 16 layers at tp 2, manual (async TP) and auto-placed; b: DeepSeek V3
# 16B cut to 6 layers, dp_shard 2 x ep 2, manual and auto-placed (ep pinned), beside torchtitan compile
O=$1
timeout 230 python bench/run.py --suite multi --gpus 2 --groups "8B-16L tp2,8B-16L tp2 auto" --only "gt aot_fx_trace full,gt full auto-placed" --steps 8 --timeout 100 --out $O/a --runs-dir /tmp/runs_s24c4 --bytecode-cache > $O/a.out 2>&1
timeout 300 python bench/run.py --suite multi --gpus 2 --groups "DeepSeek 16B-6L dp2 ep2,DeepSeek 16B-6L dp2 ep2 auto" --only "gt aot_fx_trace full,gt full auto-placed" --steps 8 --timeout 130 --out $O/b --runs-dir /tmp/runs_s24c4 --bytecode-cache > $O/b.out 2>&1
cd /tmp && for f in runs_s24c4/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_s24c4/*/metrics.jsonl runs_s24c4/*/log.txt runs_s24c4/*/prediction.json runs_s24c4/*/placements.json 2>/dev/null)
cd $O && for x in a b; do grep -v "NCCL INFO" $x.out > $x.txt; rm -f $x.out; done; tar czf suites.tgz a b && rm -rf a b
