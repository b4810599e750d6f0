"""The cost model's prediction (prediction.json's compute_ms and step_ms) for a GPU run of llama3 or
qwen3 with manual placement (SimpleFSDP / TP), without GPUs and without memory: rank 0 of the mesh
on a fake process group, the model on the meta device, the train step traced on fake tensors, the
parameter and activation policies and the backend's graph passes applied (the recomputation and the
collective schedule the job resolves to), then priced as the compiler receives it, with
`--compile.hardware`, and its peak memory simulated (`memory_policy.step_peak_bytes`: the schedule's buckets
included, as the memory policy plans for them). Takes `graph-trainer train`'s flags; the local batch
is `--training.batch_size` over the data-parallel degrees, as in a run.

    python bench/predict_on_meta.py --model.flavor 8B --training.seq_len 8192 --training.batch_size 8 \\
        --parallelism.dp_shard 8 --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option 2 \\
        --compile.mode aot_fx_trace --compile.inductor_compilation full --compile.hardware h200

The 8B dp_shard 8 step traces and prices in about 10 s on a 2-core machine. Parameters are bf16
(the GPU's mixed precision); the attention is the CPU's SDPA kernel, priced as the GPU's (same FLOPs).

`--trace ENTRY` takes the step as a GPU job traced it instead (its trace cache's entry,
`<dump folder>/compile_cache/traces/<key>.bin`, the job's own flags beside it): the GPU's attention kernels and the
values they save, so the passes decide what that job decided (session 27 replayed a 2-GPU job's memory policy so).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from graph_trainer import defaults, graph_pickle, models
from graph_trainer.compile_cache import CompileCache
from graph_trainer.backends import get_backend
from graph_trainer.blocks import annotate_blocks
from graph_trainer.capture.fx_trace import trace_train_step
from graph_trainer.capture.optimizer_in_graph import AdamWHyper, ClipAndAdamWStep
from graph_trainer.config import parse_args
from graph_trainer.losses import build_loss
from graph_trainer.parallel import apply_activation_checkpointing
from graph_trainer.parallel.compat import init_fake_process_group
from graph_trainer.parallel.mesh import build_meshes, resolve_degrees
from graph_trainer.parallel.simple_fsdp import MixedPrecision
from graph_trainer.passes.memory_policy import activation_passes, step_peak_bytes
from graph_trainer.passes.registry import ESTIMATES, PassContext, apply_passes, graph_passes
from graph_trainer.passes.reshard import parameter_passes
from graph_trainer.placement import place_model
from graph_trainer.train_step import FunctionalTrainStep, named_buffers
from graph_trainer.units import GiB

TORCHTITAN_BETAS = (0.9, 0.95)
"""torchtitan's AdamW betas (the update's scalars change no shape, so no price)."""


def main(argv: list[str]) -> None:
    entry = None
    if "--trace" in argv:
        at = argv.index("--trace")
        entry, argv = Path(argv[at + 1]), argv[:at] + argv[at + 2:]
    cfg = parse_args(argv)
    p, t = cfg.parallelism, cfg.training
    world = p.dp_replicate * p.dp_shard * p.tp
    cfg = defaults.resolve(cfg, "cuda", world)
    init_fake_process_group(world)
    meshes = build_meshes(resolve_degrees(p.dp_replicate, p.dp_shard, p.tp, p.ep, world), "cpu")
    spec = models.get_spec(cfg.model.name)
    args = spec.job_args(cfg)
    # the block marks the per-block schedule and the memory policy read, as the trainer sets them
    model = annotate_blocks(place_model(models.build_on_meta(spec, args, "cpu"), spec, args, meshes,
                                        MixedPrecision(torch.bfloat16, torch.float32), cfg))
    apply_activation_checkpointing(model, cfg)
    step = FunctionalTrainStep(model, build_loss(t.loss, model, t.loss_chunk_tokens))
    params = [q.to_local() for q in model.parameters()]
    _, buffers = named_buffers(model)
    tokens = torch.zeros(t.batch_size // (p.dp_replicate * p.dp_shard), t.seq_len, dtype=torch.long, device="meta")
    extra: list[torch.Tensor] = []
    if cfg.compile.optimizer_in_graph:
        hyper = AdamWHyper(*TORCHTITAN_BETAS, cfg.optimizer.eps, cfg.optimizer.weight_decay, t.max_norm or float("inf"))
        step = ClipAndAdamWStep(step, hyper, False)
        scalars = [torch.zeros((), dtype=torch.float64, device="meta") for _ in ("lr", "step")]
        extra = [torch.zeros_like(q) for q in params] * 2 + scalars
    start = time.perf_counter()
    if entry is None:
        gm = trace_train_step(step, params, buffers, tokens, tokens, torch.device("cpu"), extra)
    else:
        gm = graph_pickle.loads(CompileCache(entry.parent).read(entry.stem))
    scheduling = graph_passes(get_backend(cfg.compile.inductor_compilation).pass_names(cfg.compile.passes))
    ctx = PassContext(cfg=cfg, meshes=meshes, device=torch.device("cuda"), num_params=len(params),
                      num_buffers=len(buffers), param_fqns=[s.fqn for s in step.specs], later_passes=tuple(scheduling))
    gm = apply_passes(gm, parameter_passes(cfg) + activation_passes(cfg), ctx, "train_step")
    gm = apply_passes(gm, scheduling, ctx, "train_step")
    est = ESTIMATES.pop("train_step")
    recomputed = sum(1 for n in gm.graph.nodes if n.meta.get("memory_policy") == "recomputed")
    print(f"{len(gm.graph.nodes)} nodes ({recomputed} recomputed), {time.perf_counter() - start:.1f} s, passes "
          f"{','.join(scheduling) or 'none'}: compute_ms {est.compute_s * 1e3:.1f} exposed_comm_ms "
          f"{est.exposed_comm_s * 1e3:.1f} step_ms {est.step_s * 1e3:.1f} (optimizer after the graph "
          f"{est.optimizer_s * 1e3:.1f} ms), hardware {est.hardware['hardware']}, simulated peak "
          f"{step_peak_bytes(gm, ctx) / GiB:.2f} GiB")


if __name__ == "__main__":
    main(sys.argv[1:])
