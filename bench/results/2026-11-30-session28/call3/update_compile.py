"""Inductor's compile of one parameter's in-graph AdamW update (fresh cache, one GPU, fake inputs as the compile
workers give them) at the output projection's shard (64128 x 4096, fp32 gradient, bf16 weight and moments) against
a block weight's (2048 x 4096): in session 28's call 2 a compile worker took 5.4 s on the first and 0.4-0.8 s on
the others. cProfile of the large one: where the time goes."""
import cProfile
import os
import pstats
import tempfile
import time

os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp()
import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from graph_trainer import compile_cache  # noqa: E402
from graph_trainer.passes.inductor import compile_graph, decompose  # noqa: E402


def update(p, g, m, v, coef, decay, bc2, step_size):
    g = g * coef
    p2 = p * decay
    m2 = torch.lerp(m, g.to(m.dtype), 0.1)
    v2 = torch.addcmul(v * 0.95, g.to(v.dtype), g.to(v.dtype), value=0.05)
    denom = v2.sqrt() / bc2 + 1e-8
    p.copy_(p2 + m2 * step_size / denom)
    m.copy_(m2)
    v.copy_(v2)


def compile_for(shape, profile=False):
    d = torch.device("cuda")
    with FakeTensorMode():
        bf = [torch.empty(shape, dtype=torch.bfloat16, device=d) for _ in range(3)]
        args = [bf[0], torch.empty(shape, device=d), bf[1], bf[2], torch.empty((), device=d),
                torch.empty((), dtype=torch.float64, device=d), torch.empty((), dtype=torch.float64, device=d),
                torch.empty((), dtype=torch.bfloat16, device=d)]
        gm = make_fx(update)(*args)
    inputs = compile_cache.cacheable_inputs(args)
    start = time.perf_counter()
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    compile_graph(decompose(gm, inputs), inputs, None)
    if prof:
        prof.disable()
    print(f"update {list(shape)}: compile {time.perf_counter() - start:.2f} s", flush=True)
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


torch.cuda.set_device(0)
compile_for((64, 64))
compile_for((2048, 4096))
compile_for((64128, 4096), profile=True)
compile_for((2048, 4096))
