"""Host time of one call of torch's fused symmetric-memory ops at llama3 8B-16L tp 2's shapes, against their device
time: does the host run ahead of the device, or wait for it? Run under torchrun on 2 GPUs.

The device is first given ~100 ms of queued matmuls, so a call that does not wait for the device returns in its
own host time; one that synchronises returns only after the queue drained."""

import time

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

dist.init_process_group("nccl")
rank = dist.get_rank()
torch.cuda.set_device(rank)
name = dist.group.WORLD.group_name
symm_mem.enable_symm_mem_for_group(name)
bf16 = dict(device="cuda", dtype=torch.bfloat16)
shard = torch.randn(4096, 4096, **bf16)  # a rank's half of 8192 tokens, dim 4096
w13 = [torch.randn(4096, 7168, **bf16) for _ in range(2)]  # w1, w3 at tp 2
a = torch.randn(8192, 7168, **bf16)
w2 = torch.randn(7168, 4096, **bf16)
big = torch.randn(16384, 16384, **bf16)
ops = {
    "fused_all_gather_matmul (w1, w3)": lambda: torch.ops.symm_mem.fused_all_gather_matmul(shard, w13, 0, name),
    "fused_matmul_reduce_scatter (w2)": lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, w2, "sum", 0, name),
    "mm + all_gather_into_tensor (NCCL)": lambda: [torch.mm(shard, w) for w in w13]
    + [dist.all_gather_into_tensor(torch.empty(8192, 4096, **bf16), shard)],
}
N = 40
for label, op in ops.items():
    for _ in range(5):
        op()
    torch.cuda.synchronize()
    dist.barrier()
    for _ in range(10):
        big @ big
    t0 = time.perf_counter()
    for _ in range(N):
        op()
    host = (time.perf_counter() - t0) / N * 1e3
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(N):
        op()
    end.record()
    torch.cuda.synchronize()
    device = start.elapsed_time(end) / N
    if rank == 0:
        print(f"{label}: host {host:.3f} ms a call, device {device:.3f} ms a call", flush=True)
dist.destroy_process_group()
