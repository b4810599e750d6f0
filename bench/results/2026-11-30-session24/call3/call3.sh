# 2 x H200, real NCCL, bf16 storage: the solver's overlap pricing (df23872) on two more configurations, each auto-placed
# run beside our manual one: llama3 1B dp_shard 2 (2 x 4096 a rank; torchtitan compile too) and llama3 8B cut to 16
# layers at tp 2 (1 x 8192, selective AC), where the solver now gathers the weights over the tp ranks and splits the
# sequence (attention's heads moved by all-to-all) instead of Megatron's column/row split
O=$1
timeout 200 python bench/run.py --suite multi --gpus 2 --groups "1B dp2,1B dp2 auto" --only "titan compile,gt aot_fx_trace full,gt full auto-placed" --steps 8 --timeout 90 --out $O/a --runs-dir /tmp/runs_s24c3 --bytecode-cache > $O/a.out 2>&1
timeout 260 python bench/run.py --suite multi --gpus 2 --groups "8B-16L tp2,8B-16L tp2 auto" --only "gt aot_fx_trace full,gt full auto-placed" --steps 8 --timeout 120 --out $O/b --runs-dir /tmp/runs_s24c3 --bytecode-cache > $O/b.out 2>&1
cd /tmp && for f in runs_s24c3/*/log.txt; do grep -v "NCCL INFO" $f > $f.x; mv $f.x $f; done; tar czf $O/runs.tgz $(ls -d runs_s24c3/*/metrics.jsonl runs_s24c3/*/log.txt runs_s24c3/*/prediction.json runs_s24c3/*/placements.json 2>/dev/null)
cd $O && for x in a b; do grep -v "NCCL INFO" $x.out > $x.txt; rm -f $x.out; done; tar czf suites.tgz a b && rm -rf a b
