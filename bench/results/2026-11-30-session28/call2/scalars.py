"""Inductor's compile time, fresh cache, on one GPU, of the in-graph optimizer's step scalars (0-dim float64 math
with pow) against one parameter's AdamW update (bf16, 2048 x 4096): which of the step's 23-node pieces took 6.1 s."""
import os
import tempfile
import time

os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp()
import torch  # noqa: E402


def scalars(lr, step):
    step_size = (lr / (1 - torch.pow(0.9, step))) * -1
    return 1 - lr * 0.1, (1 - torch.pow(0.95, step)) ** 0.5, step_size.to(torch.bfloat16)


def update(p, g, m, v, coef, decay, bc2, step_size):
    g = g * coef
    p2 = p * decay
    m2 = torch.lerp(m, g, 0.1)
    v2 = torch.addcmul(v * 0.95, g, g, value=0.05)
    denom = v2.sqrt() / bc2 + 1e-8
    p.copy_(p2 + m2 * step_size / denom)
    m.copy_(m2)
    v.copy_(v2)


d = torch.device("cuda")
f64 = dict(dtype=torch.float64, device=d)
for name, fn, args in [
    ("warm-up x + 1", lambda x: x + 1, (torch.ones(4, device=d),)),
    ("step scalars", scalars, (torch.tensor(4e-4, **f64), torch.tensor(3.0, **f64))),
    ("update 2048x4096", update, [torch.randn(2048, 4096, dtype=torch.bfloat16, device=d) for _ in range(4)]
     + [torch.tensor(1.0, device=d), torch.tensor(0.99996, **f64), torch.tensor(0.3, **f64),
        torch.tensor(-1e-3, dtype=torch.bfloat16, device=d)]),
]:
    torch._dynamo.reset()
    start = time.perf_counter()
    torch.compile(fn, fullgraph=True)(*args)
    torch.cuda.synchronize()
    print(f"{name}: first call (compile) {time.perf_counter() - start:.1f} s", flush=True)
