"""Can the compiled total-norm piece of the in-graph optimizer (_foreach_norm over many gradients) be stored?"""
import logging, sys, tempfile, time
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch._subclasses.fake_tensor import FakeTensorMode
torch._logging.set_logs(aot_autograd=logging.DEBUG) if "--logs" in sys.argv else None
from graph_trainer.passes import inductor
from graph_trainer.compile_cache import CompileCache, cacheable_inputs
dev = "cuda" if torch.cuda.is_available() else "cpu"
n = int(sys.argv[1])
shapes = [(4096 // 8, 4096), (1024 // 8, 4096), (14336 // 8, 4096), (4096 // 8, 14336), (4096,)]
mode = FakeTensorMode()
with mode:
    grads = [torch.empty(shapes[i % len(shapes)], device=dev, dtype=torch.float32) for i in range(n)]
def norm(*g):
    return torch.nn.utils.get_total_norm(list(g), 2.0, False, True)
with mode:
    gm = make_fx(norm, tracing_mode="real")(*grads)
inputs = cacheable_inputs(grads)
dec = inductor.decompose(gm, grads)
t = time.perf_counter()
art = inductor.compile_graph(dec, inputs, None)
print(dev, n, "grads:", len(dec.graph.nodes), "nodes decomposed, compiled in", round(time.perf_counter() - t, 1), "s; stored:",
      CompileCache(__import__("pathlib").Path(tempfile.mkdtemp())).store("k" * 64, art, {}), flush=True)
