# 2 x H200, real NCCL, bf16 storage on both sides, llama3 8B cut to 16 layers. a: tp 2, ours with the traced step's
# unread collectives dropped (each checkpointed block's recomputed output), beside torchtitan compile. b: pp 2, 1F1B,
# 8 microbatches of 1 x 4096, the stages compiled before the first schedule, beside torchtitan compile
O=$1
timeout 130 python bench/run.py --suite multi --gpus 2 --groups "8B-16L tp2" --only "gt aot_fx_trace full,titan compile" --steps 8 --timeout 100 --out $O/a --runs-dir /tmp/runs_a --bytecode-cache > $O/a.out 2>&1
timeout 150 python bench/run.py --suite multi --gpus 2 --groups "8B-16L pp2 1F1B" --only "gt full balanced,titan compile" --steps 8 --timeout 120 --out $O/b --runs-dir /tmp/runs_b --bytecode-cache > $O/b.out 2>&1
cd /tmp && for f in runs_[ab]/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_[ab]/*/metrics.jsonl runs_[ab]/*/log.txt 2>/dev/null)
cd $O && for x in a b; do grep -v "NCCL INFO" $x.out > $x.txt; rm -f $x.out; done; tar czf suites.tgz a b && rm -rf a b
