"""aot_fx_trace: forward + loss + backward traced by `make_fx` into ONE train-step FX graph.

The graph's inputs are the local parameter shards, the buffers and the batch; its outputs are the
loss and one gradient shard per parameter. It is traced once on fake tensors (no memory, no compute),
handed to the configured backend, and run every step. The optimizer stays outside, unless
`--compile.optimizer_in_graph` (capture/optimizer_in_graph.py) traces it in. A batch of another
shape retraces (counted in `stats["retraces"]`) instead of reusing a graph specialised to old shapes.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx

from graph_trainer.backends import get_backend

from ..graph_dump import GraphDumper
from ..models import traceable_attention
from ..parallel.compat import is_lead_process
from ..passes.compat import lazy_graph_modules
from ..passes.memory_policy import activation_passes
from ..passes.reshard import parameter_passes
from ..passes.registry import PassContext, apply_passes, graph_passes
from ..regions import BackwardSeqNr, copy_marks_to_backward
from ..train_step import FunctionalTrainStep, accumulate_grads, named_buffers
from .registry import CaptureContext
from .compat import untraced_sharding_propagation
from .block_template import expand, plan_templates, traced_layers
from .step_cache import StepCache
from .trace_cache import TraceCache
from .unread import drop_unread
from .update_tail import append_update

logger = logging.getLogger("graph_trainer")


class TraceError(RuntimeError):
    """The step cannot be traced into one graph; the message names the module and the op."""


@contextlib.contextmanager
def _module_stack(model: nn.Module) -> Iterator[list[str]]:
    """Track which module is running, so a trace failure can name it."""
    stack: list[str] = []
    names = {m: n for n, m in model.named_modules()}
    handles = []
    for module in names:
        handles.append(module.register_forward_pre_hook(lambda m, a: stack.append(names[m] or "<root>")))
        handles.append(module.register_forward_hook(lambda m, a, o: stack.pop() and None))
    try:
        yield stack
    finally:
        for h in handles:
            h.remove()


def _fake_like(mode: FakeTensorMode, t: torch.Tensor, device: torch.device, requires_grad: bool) -> torch.Tensor:
    with mode:
        fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    return fake.requires_grad_(requires_grad)


def trace_train_step(
    step: FunctionalTrainStep,
    params: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    inputs: torch.Tensor,
    labels: torch.Tensor,
    device: torch.device,
    extra: Sequence[torch.Tensor] = (),
) -> fx.GraphModule:
    """Trace `step` on fake copies of the given tensors (only shapes, dtypes and strides are read,
    so meta tensors work too) into a flat graph: (*params, *buffers, inputs, labels) -> (loss, *grads).
    A step that also updates the parameters takes its state as `extra` inputs after the batch and
    returns what it reports instead of the gradients.

    A model of repeated blocks is traced with its first few blocks and the others' ops are copies
    (capture/block_template.py); a step that updates (its forward, loss and backward are `step.fn`) gets its
    update traced apart and appended (capture/update_tail.py). `gm.meta["traced_blocks"]` says how many blocks
    ran through make_fx."""
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    fake_args = [_fake_like(mode, p, device, True) for p in params]
    fake_args += [_fake_like(mode, b, device, False) for b in buffers]
    fake_args += [_fake_like(mode, inputs, device, False), _fake_like(mode, labels, device, False)]
    fake_args += [_fake_like(mode, e, device, False) for e in extra]
    train = step.fn if extra else step
    # a template the first layer's ops do not fit is followed by one with that layer apart (block_template.py)
    plans = plan_templates(train.model) if type(train) is FunctionalTrainStep else []
    names = [*(s.fqn for s in train.specs), *train.buffer_names] if plans else []
    step_args = fake_args[: len(names) + 2]
    for plan in plans:
        with traced_layers(train.model, plan):
            part = FunctionalTrainStep(train.model, train.loss_fn, train.loss_scale)
            part_names = [*(s.fqn for s in part.specs), *part.buffer_names]
            index = {fqn: i for i, fqn in enumerate(names)}
            part_args = [step_args[index[fqn]] for fqn in part_names] + step_args[len(names):]
            template = _trace(part, len(part.specs), len(part_names), part_args, mode)
        batch: list[str | None] = [None, None]
        gm = expand(template, plan, [*part_names, *batch], list(zip([*names, *batch], step_args)), len(train.specs), mode)
        if gm is None:
            continue
        if extra:
            gm = append_update(gm, step, fake_args, len(params), mode)
        if gm is not None:
            gm.meta["traced_blocks"] = plan.traced
            gm.meta["unread_collectives"] = drop_unread(gm)
            return gm
        break
    gm = _trace(step, len(params), len(params) + len(buffers), fake_args, mode)
    gm.meta["unread_collectives"] = drop_unread(gm)
    return gm


def _trace(step: FunctionalTrainStep, n_params: int, n_state: int, fake_args: list[torch.Tensor],
           mode: FakeTensorMode) -> fx.GraphModule:
    def flat_step(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        loss, outs = step(args[:n_params], args[n_params:n_state], args[n_state], args[n_state + 1], *args[n_state + 2 :])
        return (loss, *outs)

    with _module_stack(step.model) as stack:
        try:
            # preserve_node_meta keeps `node.meta["custom"]` (regions.py's marks) and `seq_nr`;
            # BackwardSeqNr ties each backward op's `seq_nr` to its forward op, through which the
            # marks are then copied to the backward of the marked regions.
            # A lazy graph module writes its Python code only when called or printed: the passes
            # recompile the whole step several times, and with the pieces compiled it is never called
            # (on llama3 8B, torch 2.11, six recompiles took 4.6 s of a warm start, profiled).
            with (mode, fx_traceback.preserve_node_meta(), BackwardSeqNr(), traceable_attention(), untraced_sharding_propagation(),
                  lazy_graph_modules(True)):
                gm = make_fx(flat_step, tracing_mode="real")(*fake_args)
        except Exception as e:  # noqa: BLE001  (any trace failure becomes one actionable error)
            where = stack[-1] if stack else "the loss or backward"
            first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TraceError(
                f"cannot trace the train step into one graph: module {where!r} failed at "
                f"{type(e).__name__}: {first_line}; use --compile.mode eager or jit for this model"
            ) from e
    copy_marks_to_backward(gm)
    gm.meta["traced_blocks"] = len(getattr(step.model, "layers", ()))
    return gm


class TracedStep:
    """Runs the backend's compiled train-step graph and puts its gradient shards into `param.grad`."""

    def __init__(self, ctx: CaptureContext):
        self.ctx = ctx
        self.fn = FunctionalTrainStep(ctx.model, ctx.loss_fn, ctx.loss_scale)
        self.params = [p for p in ctx.model.parameters() if p.requires_grad]
        _, self.buffers = named_buffers(ctx.model)
        self.compiled: Callable[..., Any] | None = None
        self.signature: tuple | None = None
        ctx.stats.setdefault("retraces", 0)

    def _build(self, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        cfg = self.ctx.cfg
        first = self.compiled is None
        folder = None
        if cfg.compile.dump_graphs and is_lead_process():
            sub = "graphs" if first else f"graphs/retrace_{self.ctx.stats['retraces'] + 1}"
            folder = f"{cfg.job.dump_folder}/{sub}"
        dumper = GraphDumper(folder)
        t0 = time.perf_counter()
        locals_ = [p.to_local() for p in self.params]
        extra = self._extra_inputs()
        example_inputs = [*locals_, *self.buffers, inputs, labels, *extra]
        cache = TraceCache.of(cfg, self.fn.specs, example_inputs, self.ctx.device, self.ctx.meshes.degrees)
        steps = StepCache.of(cfg, cache.key) if cache is not None else None
        # a start that dumps its graphs runs the passes that make them (the same on every rank: the load is collective)
        if steps is not None and not cfg.compile.dump_graphs and self._load_decided(steps, first, t0):
            self.signature = self._signature(inputs, labels)
            return
        backend = get_backend(cfg.compile.inductor_compilation)
        gm = cache.load() if cache is not None else None
        if gm is None:
            # a step that must be traced is most likely compiled afresh too: the backend starts its compile workers now
            backend.prepare(cfg, self.ctx.device)
            gm = trace_train_step(self.fn, locals_, self.buffers, inputs, labels, self.ctx.device, extra)
            self.ctx.stats["traced_blocks"] = gm.meta["traced_blocks"]
            self.ctx.stats["unread_collectives"] = gm.meta["unread_collectives"]
        t1 = time.perf_counter()
        outcome = cache.outcome if cache is not None else "off"
        logger.info(f"{'loaded' if outcome == 'hit' else 'traced'} the train step: {len(gm.graph.nodes):,} nodes in {t1 - t0:.1f} s")
        self.ctx.stats["trace_cache"] = outcome
        if cache is not None and outcome != "hit":
            # the passes change the graph from here on: the store holds it as traced
            cache.store_aside(gm)
            self.ctx.stats["trace_store_s"] = time.perf_counter() - t1
        dumper.dump("traced", gm)
        pctx = PassContext(
            cfg=cfg,
            meshes=self.ctx.meshes,
            device=self.ctx.device,
            example_inputs=example_inputs,
            dumper=dumper,
            num_params=len(self.params),
            num_buffers=len(self.buffers),
            param_fqns=[s.fqn for s in self.fn.specs],
            later_passes=tuple(graph_passes(backend.pass_names(cfg.compile.passes))),
        )
        # The parameter and activation policies decide what the traced step saves before any backend pass sees it;
        # the backend's passes price the step where they end.
        t2 = time.perf_counter()
        gm = apply_passes(gm, parameter_passes(cfg) + activation_passes(cfg), pctx, "train_step", price=False)
        self.compiled = backend.compile(gm, pctx)
        t3 = time.perf_counter()
        if not first:
            self.ctx.stats["retraces"] += 1
        self.ctx.stats.update(trace_s=t1 - t0, compile_s=t3 - t2, graph=dumper.stages)
        for figures in pctx.report.values():
            self.ctx.stats.update(figures)
        if steps is not None:
            self.ctx.stats["step_cache"] = steps.outcome
            steps.store(self.compiled, pctx.report)
        self.signature = self._signature(inputs, labels)

    def _load_decided(self, steps: StepCache, first: bool, t0: float) -> bool:
        """Run the step a start of this job decided and stored (step_cache.py), where every rank has it."""
        loaded = steps.load(self.ctx)
        self.ctx.stats["step_cache"] = steps.outcome
        if loaded is None:
            return False
        self.compiled, figures = loaded
        seconds = time.perf_counter() - t0
        logger.info(f"loaded the decided step: {len(self.compiled.fn.order)} pieces, {figures['compile_cache_entries_loaded']} "
                    f"compiled, in {seconds:.1f} s")
        if not first:
            self.ctx.stats["retraces"] += 1
        self.ctx.stats.update(figures, trace_s=seconds, compile_s=0.0, trace_cache="unused")
        return True

    @staticmethod
    def _signature(inputs: torch.Tensor, labels: torch.Tensor) -> tuple:
        return (tuple(inputs.shape), inputs.dtype, tuple(labels.shape), labels.dtype)

    def _extra_inputs(self) -> list[torch.Tensor]:
        """Graph inputs after the batch: none here; a step that updates the parameters adds its state."""
        return []

    def _finish(self, out: Sequence[torch.Tensor]) -> torch.Tensor:
        """Take the graph's outputs (loss, *grads) and return the loss."""
        accumulate_grads(self.params, self.fn.specs, out[1:])
        return out[0]

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        built = self.signature != self._signature(inputs, labels)
        if built:
            self._build(inputs, labels)
        assert self.compiled is not None
        start = time.perf_counter()
        # The graph computes its own gradients: autograd must not record it as well.
        with torch.no_grad():
            out = self.compiled(*[p.to_local() for p in self.params], *self.buffers, inputs, labels, *self._extra_inputs())
        if built:
            # host time of a compiled step's first call: loading its kernels, creating the communicators
            self.ctx.stats["first_call_s"] = time.perf_counter() - start
        return self._finish(out)
