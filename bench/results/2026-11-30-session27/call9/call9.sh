# 2 x H200, real NCCL: llama3 1B dp_shard 2, 2 x 4096 a rank. The schedule's reductions outside the blocks changed
# (buckets of one, waited for when the cost model expects them done): the 1B's output projection is a larger share of
# its gradients (128256 x 2048). torchtitan compile beside our default, to check for a regression (session 23: 1.05x).
O=$1
timeout 200 python bench/run.py --suite multi --gpus 2 --groups "1B dp2" --only "titan compile,gt aot_fx_trace full" --steps 8 --timeout 90 --out $O/a --runs-dir /tmp/runs_s27c9 --bytecode-cache > $O/a.out 2>&1
cd /tmp && for f in runs_s27c9/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_s27c9/*/metrics.jsonl runs_s27c9/*/log.txt runs_s27c9/*/prediction.json 2>/dev/null)
cd $O && grep -v "NCCL INFO" a.out > a.txt; rm -f a.out; tar czf suites.tgz a && rm -rf a
