"""The one registry of graph passes. A pass is `fn(gm, ctx) -> gm` plus a declaration whose
constraints are data: the validator (`passes/validate.py`) reads them before anything heavy runs,
`--compile.list_passes` prints them, and every mode and backend applies passes only through
`apply_passes`. The registry knows no pass: each registers itself, and the package (`__init__.py`)
imports them all.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch
from torch import fx

from .step_estimate import GraphEstimate, estimate_graph

logger = logging.getLogger("graph_trainer")

Stage = Literal["joint", "forward", "backward", "train_step"]
STAGES: tuple[Stage, ...] = ("joint", "forward", "backward", "train_step")
GRAPH_MODES = ("jit", "aot", "aot_fx_trace")
"""The capture modes that produce graphs (eager has none, so no pass runs in it)."""


@dataclass
class PassContext:
    """What a pass may read: the config, meshes, example inputs of the graph, the dumper."""

    cfg: Any
    meshes: Any
    device: torch.device
    example_inputs: list[Any] = field(default_factory=list)
    dumper: Any = None
    num_params: int = 0
    """How many leading graph inputs are parameter shards (static addresses for cudagraph)."""
    num_buffers: int = 0
    param_fqns: list[str] = field(default_factory=list)
    stage: Stage = "train_step"
    """The stage of the graph being transformed; `apply_passes` sets it."""
    report: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Figures a pass reports, by pass name: recorded with its stage in the dumps' summary.json; the
    capture adds them to its stats (the log and the step-1 metrics record). `apply_passes` adds each
    pass's wall seconds on each stage (`pass_<dump label>_s`): the time to the first step, by pass."""
    later_passes: tuple[str, ...] = ()
    """The backend's passes this graph goes through after the activation passes, up to its lowering
    (`graph_passes`): a pass that budgets memory applies them to a copy to see the step as the
    compiler gets it (the collective schedule's buckets and prefetches)."""
    meanwhile: Callable[[], None] = lambda: None
    """Work a pass that `waits` does while it waits (`apply_passes` puts the step estimate of the graph the pass was
    given here); it runs once, after the pass where the pass did not run it."""


PassFn = Callable[[fx.GraphModule, PassContext], Any]


@dataclass(frozen=True)
class PassSpec:
    name: str
    description: str
    """One line for `--compile.list_passes`."""
    stages: tuple[Stage, ...]
    """Graphs the pass transforms; on other stages `apply_passes` skips it."""
    modes: tuple[str, ...]
    """Capture modes (`--compile.mode`) the pass supports."""
    fn: PassFn
    requires: tuple[str, ...] = ()
    """Passes that must run before this one."""
    conflicts: tuple[str, ...] = ()
    """Passes that cannot run together with this one (checked in both directions)."""
    must_be_last: bool = False
    cuda_only: bool = False
    compiles: bool = False
    """The pass returns a compiled callable, not a graph to transform: no graph pass may follow it."""
    lowers: bool = False
    """The pass rewrites the graph into the compiler's op set (the same step in other ops): the step
    estimate prices the graph before it, as it does before a compiling pass."""
    waits: bool = False
    """The pass may wait on other processes (the compile workers) and calls `ctx.meanwhile()` while it does; it leaves
    the graph it was given as it was. The step estimate of that graph is made then, off the path to the first step
    (one H200, llama3 8B as rank 0 of dp_shard 8 with the in-graph optimizer: 0.21-0.41 s while the workers compiled;
    made on the path, before the pass and once more before that, 0.74-0.82 s each; bench/results/2026-12-01-session33)."""
    wraps_compiled: bool = False
    """The pass wraps whatever callable it gets, so it may follow a compiling pass."""
    excluded_backends: tuple[str, ...] = ()
    """`--compile.inductor_compilation` backends that do this pass's job themselves: refused with them."""
    env_defaults: tuple[tuple[str, str], ...] = ()
    """Environment variables the pass needs set before any process group exists (unless the user set them)."""
    set_by: str = ""
    """The flag that adds this pass (in front of the others); it is refused in --compile.passes."""
    needs_degrees: tuple[str, ...] = ()
    """Parallelism degrees (`parallelism.<name>`) that must be > 1: the communication the pass
    transforms exists only then."""


PASSES: dict[str, PassSpec] = {}
ESTIMATES: dict[str, GraphEstimate] = {}
"""The cost model's estimate of each stage's graph as last captured, as it reached the compiling pass
(or the end of the passes): the graph the backend compiles (prediction.json reads them)."""


@dataclass(frozen=True)
class OptionSpec:
    """A lever that is a setting, not a pass, with its constraints as data: `passes/validate.py`
    checks them as it checks a pass's, before anything heavy runs."""

    flag: str
    """`section.key` of the setting."""
    on: Any
    """The value that turns the lever on."""
    description: str
    modes: tuple[str, ...]
    """Capture modes (`--compile.mode`) it works in."""
    conflicts: tuple[str, ...] = ()
    """Passes it cannot run with (named in --compile.passes or added by the backend)."""
    excluded_backends: tuple[str, ...] = ()
    """`--compile.inductor_compilation` backends it cannot run with."""
    requires: tuple[tuple[str, Any, str], ...] = ()
    """Settings that must hold with it: (`section.key`, value, why)."""


OPTIONS: tuple[OptionSpec, ...] = (
    OptionSpec(
        flag="compile.optimizer_in_graph", on=True,
        description="gradient clipping and the AdamW update traced into the train-step graph",
        modes=("aot_fx_trace",),
        # cudagraph copies every input after the parameters and buffers into static buffers: the
        # optimizer state the graph updates in place would be updated in those copies only.
        conflicts=("cudagraph",),
        excluded_backends=("autoparallel_backend",),
        requires=(
            ("training.gradient_accumulation_steps", 1, "the update runs in the graph of the one microbatch"),
            ("optimizer.name", "AdamW", "the traced update is AdamW's"),
        ),
    ),
    OptionSpec(
        flag="training.loss", on="fused_linear_ce",
        description="output projection + cross-entropy chunked over tokens (no whole logits)",
        modes=("eager", "jit", "aot", "aot_fx_trace"),
        requires=(
            ("parallelism.tp", 1, "tensor parallelism shards the vocabulary of the output projection"),
            ("compile.autoparallel", False, "the solver places the output projection itself"),
        ),
    ),
)


def register_pass(spec: PassSpec) -> PassSpec:
    assert spec.name not in PASSES, spec.name
    assert spec.stages and set(spec.stages) <= set(STAGES), (spec.name, spec.stages)
    assert set(spec.modes) <= set(GRAPH_MODES), (spec.name, spec.modes)
    PASSES[spec.name] = spec
    return spec


class Compiled:
    """What a compiling pass returns: calls `fn` with the graph's inputs and keeps the FX graph it was
    built from (`graph_module`, for the dumps).

    The call runs without autograd recording: the train-step graph already holds its backward, and
    its parameter inputs require grad, which compiled kernels writing into `out=` buffers refuse.
    `boxed`: `fn` takes one list of inputs (Inductor's and AOTAutograd's convention). `cache_key`: the
    compile-cache entry that holds `fn` (loaded from it or stored in it), where one does.
    """

    def __init__(self, fn: Callable[..., Any], graph_module: fx.GraphModule | None, boxed: bool = False,
                 cache_key: str | None = None):
        self.fn = fn
        self.graph_module = graph_module
        self.boxed = boxed
        self.cache_key = cache_key

    def __call__(self, *args: Any) -> Any:
        with torch.no_grad():
            return self.fn(list(args)) if self.boxed else self.fn(*args)


def graph_passes(names: list[str]) -> list[str]:
    """The leading passes of `names` that hand a graph on: those before the first that lowers or compiles."""
    return list(itertools.takewhile(lambda name: not (PASSES[name].compiles or PASSES[name].lowers), names))


def apply_passes(gm: fx.GraphModule, names: list[str], ctx: PassContext, stage: Stage, price: bool = True) -> Any:
    """Run the named passes in order on one graph of `stage`, dumping after each.

    After a compiling pass the dump holds the FX graph the compiled callable was built from, marked
    `compiled: true` in summary.json, so every stage of every backend appears in the dumps. The graph
    that reaches the first lowering or compiling pass (or the end) is priced into `ESTIMATES`, unless
    `price` is False: the graph goes on to more passes of its stage, which price it where it ends.
    """
    ctx = dataclasses.replace(ctx, stage=stage)
    result: Any = gm
    unpriced = price
    for name in names:
        spec = PASSES[name]
        if stage not in spec.stages:
            continue
        pass_ctx = ctx
        estimate: Callable[[], None] = lambda: None
        if (spec.compiles or spec.lowers) and unpriced:
            unpriced = False
            estimate = functools.cache(functools.partial(_record_estimate, result, ctx))
            if spec.waits:
                pass_ctx = dataclasses.replace(ctx, meanwhile=estimate)
            else:
                estimate()
        label = f"{stage}_{name}" if stage != "train_step" else name
        start = time.perf_counter()
        result = spec.fn(result, pass_ctx)
        seconds = time.perf_counter() - start
        estimate()
        ctx.report.setdefault(name, {})[f"pass_{label}_s"] = seconds
        # In the log as each pass ends: a run stopped before its first step still shows where its time went.
        logger.info(f"pass {label}: {seconds:.1f} s")
        if ctx.dumper is None:
            continue
        # A copy: a pass run on several stages (aot's forward and backward) reports into one dict.
        report = dict(ctx.report[name])
        if isinstance(result, fx.GraphModule):
            ctx.dumper.dump(label, result, report=report)
        elif isinstance(getattr(result, "graph_module", None), fx.GraphModule):
            ctx.dumper.dump(label, result.graph_module, compiled=True, report=report)
    if unpriced:
        _record_estimate(result, ctx)
    return result


def _record_estimate(gm: Any, ctx: PassContext) -> None:
    """A job's graph (not a bare one a test builds) as the compiler gets it: prediction.json prices it. Its seconds are
    reported (`step_estimate_<stage>_s`), the first step's record showing whether they were spent on its path."""
    if ctx.cfg is not None and isinstance(gm, fx.GraphModule):
        start = time.perf_counter()
        ESTIMATES[ctx.stage] = estimate_graph(gm, ctx)
        ctx.report.setdefault("step_estimate", {})[f"step_estimate_{ctx.stage}_s"] = time.perf_counter() - start


_TEARDOWNS: list[Callable[[], None]] = []


def register_teardown(fn: Callable[[], None]) -> None:
    """Run `fn` at `run_teardowns()`, which the trainer calls before it destroys the process group
    (a captured CUDA graph that still references NCCL resources then can hang the exit)."""
    if fn not in _TEARDOWNS:
        _TEARDOWNS.append(fn)


def run_teardowns() -> None:
    while _TEARDOWNS:
        _TEARDOWNS.pop()()
