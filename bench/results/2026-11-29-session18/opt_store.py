"""graph-trainer train, the rank compiling every piece itself; a piece whose compile cannot be stored is written out,
with the caches' bypass counters and log lines."""
import logging, os, sys
import torch
for name in ("torch._functorch._aot_autograd.autograd_cache", "torch._inductor.codecache"):
    lg = logging.getLogger(name)
    lg.setLevel(logging.DEBUG)
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("CACHELOG %(name)s: %(message)s"))
    lg.addHandler(h)
from graph_trainer import compile_cache
from graph_trainer.passes import inductor
last = {}
real_compile = inductor.compile_graph
def compile_graph(gm, inputs, options):
    from torch._dynamo.utils import counters
    counters.clear()
    last["gm"] = gm
    art = real_compile(gm, inputs, options)
    last["counters"] = {k: dict(v) for k, v in counters.items() if k in ("aot_autograd", "inductor")}
    return art
inductor.compile_graph = compile_graph
real_store = compile_cache.CompileCache.store
def store(self, key, artifact, parts):
    ok = real_store(self, key, artifact, parts)
    if not ok:
        out = os.environ["OUT"]
        k = len([f for f in os.listdir(out) if f.startswith("failed")])
        with open(f"{out}/failed{k}.txt", "w") as f:
            f.write(repr(last.get("counters")) + "\n" + last["gm"].print_readable(print_output=False))
        print("FAILED PIECE", k, last.get("counters"), file=sys.stderr)
    return ok
compile_cache.CompileCache.store = store
from graph_trainer.cli import entry_point
sys.exit(entry_point())
