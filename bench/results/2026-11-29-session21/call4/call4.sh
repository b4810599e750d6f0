# 2 x H200, real NCCL: llama3 8B cut to 16 layers, pp 2, 8 microbatches of 1 x 4096, 1F1B and Interleaved1F1B, bf16
# storage on both sides, as call 2, with the stages recomputing the blocks selective AC wraps (checkpoint_tags: in call 2
# the traced stages recomputed nothing)
O=$1
timeout 570 python bench/run.py --suite multi --gpus 2 --groups "8B-16L pp2 1F1B,8B-16L pp2 Interleaved1F1B" --only "titan compile,gt full balanced,gt aot_fx_trace full" --steps 8 --timeout 150 --out $O/d --runs-dir /tmp/runs_d --bytecode-cache > $O/d.out 2>&1
cd /tmp && for f in runs_d/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_d/*/metrics.jsonl runs_d/*/log.txt 2>/dev/null)
cd $O && grep -v "NCCL INFO" d.out > d.txt; rm -f d.out; tar czf suites.tgz d && rm -rf d
