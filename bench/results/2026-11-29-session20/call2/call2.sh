# 2 x H200, real NCCL: the token embedding read in place (auto: `gt aot_fx_trace full`) against gathered
# (`gt full embedding gather`), beside torchtitan compile, on the 1B and 8B-16L at dp_shard 2, then DeepSeek V3 16B-6L
O=$1
timeout 170 python bench/run.py --suite multi --gpus 2 --groups "1B dp2" --only "titan compile,gt aot_fx_trace full,gt full embedding gather" --steps 8 --timeout 70 --out $O/a --runs-dir /tmp/runs_a --bytecode-cache > $O/a.out 2>&1
timeout 190 python bench/run.py --suite multi --gpus 2 --groups "8B-16L dp2" --only "gt full embedding gather,gt aot_fx_trace full,titan compile" --steps 8 --timeout 75 --out $O/b --runs-dir /tmp/runs_b --bytecode-cache > $O/b.out 2>&1
timeout 200 python bench/run.py --suite multi --gpus 2 --groups "DeepSeek 16B-6L dp2 ep2" --only "titan compile,gt aot_fx_trace full" --steps 8 --timeout 100 --out $O/c --runs-dir /tmp/runs_c --bytecode-cache > $O/c.out 2>&1
cd /tmp && for f in runs_*/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_*/*/metrics.jsonl runs_*/*/log.txt 2>/dev/null)
cd $O && for x in a b c; do grep -v "NCCL INFO" $x.out > $x.txt; rm -f $x.out; done; tar czf suites.tgz a b c && rm -rf a b c
