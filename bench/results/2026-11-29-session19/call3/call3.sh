# workers at nice 10 (A, this tree) against nice 0 (B, a copy without os.nice), each beside torchtitan compile, A B A B
O=$1; B=/tmp/tree_b
rm -rf $B && mkdir -p $B && git ls-files -z --cached --others --exclude-standard | grep -zv "^diag/" | xargs -0 tar cf - | tar xf - -C $B
sed -i "s/os.nice({NICE}); //" $B/graph_trainer/worker_processes.py
diff graph_trainer/worker_processes.py $B/graph_trainer/worker_processes.py
S=${PYTHONPATH%%:*}
G="--suite scale --groups 8B_dp8 --steps 5 --timeout 90 --bytecode-cache"
for r in "a1:$PWD:titan compile,gt aot_fx_trace full" "b1:$B:gt aot_fx_trace full,titan compile" "a2:$PWD:gt aot_fx_trace full,titan compile" "b2:$B:titan compile,gt aot_fx_trace full"; do
  name=${r%%:*}; rest=${r#*:}; tree=${rest%%:*}; only=${rest#*:}
  (cd $tree && PYTHONPATH=$S:$tree python bench/run.py --suite scale --groups "8B dp8" --only "$only" --steps 5 --timeout 90 --out $O/$name --runs-dir /tmp/runs_$name --bytecode-cache > $O/$name.out 2>&1)
  echo "== $name"; grep "^| 8B dp8" $O/$name/*.md | head -3
done
cd /tmp && tar czf $O/runs.tgz $(ls -d runs_*/*/metrics.jsonl runs_*/*/log.txt)
cd $O && tar czf suites.tgz a1 b1 a2 b2 *.out && rm -rf a1 b1 a2 b2 *.out
