"""What one eager training step executes on one fake rank, on CPU: graph-trainer's or torchtitan 0.2.2's.

torchtitan's Trainer needs a GPU, so its side is its own `parallelize_llama` (TP with loss parallel,
selective AC, FSDP2) and the step its Trainer runs (summed cross-entropy over tokens, clip, AdamW);
graph-trainer's is `GraphTrainer.train_step`. Both on torch's fake process group with the collective
kernels of graph_trainer.parallel.fake_data (as bench/titan_spec.py gives torchtitan on the GPU).

Counted per step (after one warm-up step), by a dispatch mode that lets DTensor run so that its local
ops are what is counted: aten ops, matmul FLOPs, bytes read and written by ops that are not views,
calls of `DTensor.redistribute`, and the host CPU time of a step (median of `--timing` steps; at a
small size this is dispatch overhead, which a GPU step must hide behind its kernels).

    python bench/step_ops.py --trainer gt --dp 2 --tp 2 --layers 8 --seq 32 --timing 15
    python bench/step_ops.py --trainer titan --dp 2 --tp 2 --layers 8 --seq 32 --timing 15
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

NO_DATA = {"_c10d_functional.wait_tensor", "_c10d_functional._wrap_tensor_autograd", "_unsafe_view", "empty", "detach",
           "lift_fresh", "_local_scalar_dense"}
"""Ops that move no data, though their schemas declare no alias."""


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter = collections.Counter()
        self.flops: collections.Counter = collections.Counter()
        self.bytes: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs the op; its local ops come back here
        out = func(*args, **kwargs)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if any(t.device.type == "meta" or type(t).__name__ == "FakeTensor" for t in tensors):
            return out  # DTensor's sharding propagation
        name = func.overloadpacket.__name__ if func.namespace == "aten" else f"{func.namespace}.{func.overloadpacket.__name__}"
        self.calls[name] += 1
        if func.overloadpacket in flop_registry:
            shape = lambda x: x.shape if isinstance(x, torch.Tensor) else x
            self.flops[name] += flop_registry[func.overloadpacket](*tree_map(shape, args), **tree_map(shape, kwargs), out_val=out)
        is_view = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        if not is_view and name not in NO_DATA:
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            self.bytes[name] += sum(t.numel() * t.element_size() for t in tensors + outs)
        return out


def _register_mini8b() -> None:
    """llama3 8B's proportions at 1/8 width (head_dim 64, 4 query heads a kv head, vocabulary 31x the
    width): with `--seq 1024` a rank's tokens per model width match 8B's at 8192."""
    from torchtitan.models.llama3 import TransformerModelArgs

    from graph_trainer import models

    models.get_spec("llama3").flavors["mini8b"] = TransformerModelArgs(
        dim=512, n_layers=4, n_heads=8, n_kv_heads=2, vocab_size=16032, ffn_dim_multiplier=1.3, multiple_of=1024,
        rope_theta=500000)


def _gt_step(a: argparse.Namespace, world: int, dump: str):
    from graph_trainer.config import parse_args
    from graph_trainer.trainer import GraphTrainer

    cfg = parse_args(["--model.flavor", a.flavor, "--model.n_layers", str(a.layers), "--training.seq_len", str(a.seq),
                      "--training.batch_size", str(a.dp), "--training.random_tokens", "--training.no-deterministic",
                      "--comm.mode", "fake", "--comm.fake_world_size", str(world), "--parallelism.dp_shard", str(a.dp),
                      "--parallelism.tp", str(a.tp), "--activation_checkpoint.mode", "selective",
                      "--training.mixed_precision_param", a.dtype, "--compile.mode", "eager", "--job.dump_folder", dump])
    trainer = GraphTrainer(cfg)

    def step() -> None:
        trainer.step += 1
        trainer.train_step()

    return step


def _titan_step(a: argparse.Namespace, world: int):
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3.infra.parallelize import parallelize_llama

    from graph_trainer import models
    from graph_trainer.parallel.compat import init_fake_process_group
    from graph_trainer.parallel.fake_data import fill_collective_outputs

    parallel_dims.device_type = "cpu"  # torchtitan assumes a GPU where none is found
    init_fake_process_group(world, 0)
    fill_collective_outputs()
    spec = models.get_spec("llama3")
    args = spec.args_for(a.flavor, a.seq, a.layers, "flavor", 0)
    job = JobConfig()
    job.training.seq_len, job.training.mixed_precision_param = a.seq, a.dtype
    job.activation_checkpoint.mode = "selective"
    dims = ParallelDims(dp_replicate=1, dp_shard=a.dp, cp=1, tp=a.tp, pp=1, ep=1, etp=1, world_size=world)
    dims.build_mesh()
    with torch.device("meta"):
        model = spec.model_cls(args)
    parallelize_llama(model, dims, job)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=8e-4, foreach=True)
    context = dist_utils.get_train_context(dims.tp_enabled and not job.parallelism.disable_loss_parallel)
    generator = torch.Generator().manual_seed(0)

    def step() -> None:
        tokens = torch.randint(0, args.vocab_size, (1, a.seq + 1), generator=generator)
        optimizer.zero_grad()
        with context():
            loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:]) / a.seq
            loss.backward()
        dist_utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
        optimizer.step()

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trainer", choices=("gt", "titan"), required=True)
    p.add_argument("--dp", type=int, default=2, help="dp_shard degree")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--flavor", default="debugmodel", help="a llama3 flavor, or mini8b (see _register_mini8b)")
    p.add_argument("--layers", type=int, default=0, help="0: the flavor's")
    p.add_argument("--seq", type=int, default=256, help="tokens of the rank's one sequence")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="parameters' compute dtype")
    p.add_argument("--timing", type=int, default=0, help="steps to time (host CPU seconds)")
    p.add_argument("--out", type=Path, help="write the counts here (JSON)")
    a = p.parse_args()
    _register_mini8b()
    world = a.dp * a.tp
    if a.trainer == "gt":
        import tempfile

        step = _gt_step(a, world, tempfile.mkdtemp())
    else:
        step = _titan_step(a, world)
    step()
    redistributes = []
    original = DTensor.redistribute

    def counted(self, *args, **kwargs):
        redistributes.append(1)
        return original(self, *args, **kwargs)

    DTensor.redistribute = counted
    counter = OpCounter()
    with counter:
        step()
    DTensor.redistribute = original
    result = {"ops": sum(counter.calls.values()), "data_ops": sum(c for n, c in counter.calls.items() if counter.bytes[n]),
              "gflop": sum(counter.flops.values()) / 1e9, "data_mb": sum(counter.bytes.values()) / 1e6,
              "redistribute_calls": len(redistributes)}
    if a.timing:
        seconds = []
        for _ in range(a.timing):
            start = time.process_time()
            step()
            seconds.append(time.process_time() - start)
        result["host_s_median"] = statistics.median(seconds)
    print(json.dumps(result))
    if a.out:
        a.out.write_text(json.dumps({**result, "calls": counter.calls, "flops": counter.flops, "bytes": counter.bytes}, indent=1))


if __name__ == "__main__":
    main()
