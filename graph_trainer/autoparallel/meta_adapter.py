"""`--compile.autoparallel_impl meta`: placement chosen and applied by Meta's AutoParallel
(github.com/meta-pytorch/autoparallel) instead of the built-in solver, and its cost model asked to
price a plan (`graph-trainer plan --against meta`).

The package is optional and not on the package registries (`META_AUTOPARALLEL_INSTALL` says how to
install it; `.ci/run` installs the wheel from `../shared/autoparallel/` when that folder exists).
What this adapter relies on, as read at commits da99589 (torch 2.11) and a54c252 (torch 2.13):
`AutoParallel(model, input_fn, mesh, mp_policy)` is a context manager that traces the meta-device
model's forward and backward on fake tensors of `input_fn()`'s shapes (`build_model_graph`) and
builds its integer program (`sharding_optimizer`); inside it `add_parameter_memory_constraint(low,
high)` bounds each rank's share of the parameters, `add_input_constraints` / `add_output_constraints`
fix the placements of the batch and of the output, `optimize_placement()` solves the program and
`apply_placement(solution)` returns a module whose parameters are DTensors in the chosen layouts
(same FQNs, still on meta: `materialize` fills them) and whose forward runs the placed graphs;
`sharding_optimizer.save_placements(path)` / `load_placements(path)` write a solution as JSON by node
name and read it back as a solution.
This module is the one place that reaches into the package's internals (its optimizer's costs, its
device table) and into the descriptors of its traced graph.

What it does not cover: MoE models (its MoE support needs its own model definitions) and plan files
(they are the built-in solver's). `check_autoparallel` refuses those combinations up front.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..config import ConfigError
from ..passes.bucketing_compat import META_AUTOPARALLEL_INSTALL
from ..units import GiB
from .costs import state_bytes_per_element
from .planner import DP_DIMS

logger = logging.getLogger("graph_trainer")

_API = ("add_parameter_memory_constraint", "add_input_constraints", "add_output_constraints", "optimize_placement", "apply_placement")
PRICED_AS = "H100"
"""The GPU whose numbers Meta's compute estimate uses where the device cannot name itself (CPU)."""


def auto_parallel_class() -> type | None:
    """Meta's `AutoParallel` if its package imports and has the API above, else None."""
    try:
        api = importlib.import_module("autoparallel.api")
    except Exception:  # noqa: BLE001  (a broken install on this torch counts as missing)
        return None
    cls = getattr(api, "AutoParallel", None)
    return cls if cls is not None and all(hasattr(cls, name) for name in _API) else None


def require() -> type:
    cls = auto_parallel_class()
    if cls is None:
        raise ConfigError(
            f"--compile.autoparallel_impl meta needs Meta's autoparallel package, which is not importable here: "
            f"{META_AUTOPARALLEL_INSTALL}; or use --compile.autoparallel_impl builtin"
        )
    return cls


@contextlib.contextmanager
def _device_named(name: str) -> Iterator[None]:
    """Meta's compute estimate looks its FLOP/s and bandwidth up by `torch.get_device_module()
    .get_device_name()`, which `torch.cpu` lacks (AttributeError on every CPU rank): there it gets the
    table row of `name`, the GPU the plan is priced for."""
    if hasattr(torch.get_device_module(), "get_device_name"):
        yield
        return
    estimation = importlib.import_module("autoparallel.cost_models.compute_estimation")
    (limit,) = [d for d in estimation.DEVICE_LIMITS if d.name == name]
    original = estimation._get_device_limit
    estimation._get_device_limit = lambda: limit
    try:
        yield
    finally:
        estimation._get_device_limit = original


def _refuses_grouped_query(count: Any) -> bool:
    try:
        count((1, 2, 1, 1), (1, 1, 1, 1), (1, 1, 1, 1))
    except AssertionError:
        return True
    return False


@contextlib.contextmanager
def _grouped_query_flops() -> Iterator[None]:
    """torch 2.11's FLOP formulas for attention assert that k and v have as many heads as q, but CUDA
    SDPA takes llama3's grouped-query k and v unexpanded (`enable_gqa`), so Meta's compute estimate
    stops in them on the GPU. Where they refuse such shapes, k and v are counted broadcast to q's heads,
    as the kernel computes them (torch 2.13's own formulas do the same)."""
    from torch.utils import flop_counter as counter

    forward, backward = counter.sdpa_flop_count, counter.sdpa_backward_flop_count
    if not _refuses_grouped_query(forward):
        yield
        return

    def broadcast(q: tuple[int, ...], kv: tuple[int, ...]) -> tuple[int, ...]:
        return (kv[0], q[1], *kv[2:])

    counter.sdpa_flop_count = lambda q, k, v: forward(q, broadcast(q, k), broadcast(q, v))
    counter.sdpa_backward_flop_count = lambda g, q, k, v: backward(g, q, broadcast(q, k), broadcast(q, v))
    try:
        yield
    finally:
        counter.sdpa_flop_count, counter.sdpa_backward_flop_count = forward, backward


@dataclass
class Session:
    """An entered AutoParallel with its constraints set, and how long tracing and building took."""

    autop: Any
    trace_s: float
    build_s: float
    param_nodes: dict[str, torch.fx.Node]

    @property
    def optimizer(self) -> Any:
        return self.autop.sharding_optimizer


@contextlib.contextmanager
def session(model: nn.Module, batch_shape: tuple[int, int], mesh: DeviceMesh, mp: Any, memory_budget: float) -> Iterator[Session]:
    """Trace `model` (meta device) for a global `batch_shape` token batch and build Meta's program on
    `mesh` (the mesh dims of size > 1), batch and output sharded on the data-parallel dims."""
    from torch._functorch._aot_autograd.fx_utils import get_named_param_nodes
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from .compat import register_cpu_attention_strategies

    auto_parallel = require()
    batch = tuple(Shard(0) if name in DP_DIMS else Replicate() for name in mesh.mesh_dim_names)
    state = sum(p.numel() * state_bytes_per_element(p.element_size()) for p in model.parameters())
    ranks = math.prod(mesh.shape)
    if memory_budget < state / ranks:
        smallest = math.ceil(state / ranks / GiB * 100) / 100
        raise ConfigError(f"autoparallel: the memory budget {memory_budget / GiB:.2f} GiB per rank is infeasible; set "
                          f"--compile.autoparallel_memory_budget {smallest:.2f}GiB or more, or use more ranks")
    # the same batch- and head-parallel attention options the built-in solver has on CPU (else Meta
    # registers the CPU flash kernel replicate-only)
    register_cpu_attention_strategies()
    timings: dict[str, float] = {}

    class Timed(auto_parallel):  # type: ignore[misc, valid-type]
        def build_model_graph(self) -> None:
            t0 = time.perf_counter()
            super().build_model_graph()
            timings["trace_s"] = time.perf_counter() - t0

    def input_fn() -> torch.Tensor:
        return torch.zeros(batch_shape, dtype=torch.long, device=mesh.device_type)

    policy = MixedPrecisionPolicy(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype)
    with _device_named(PRICED_AS), _grouped_query_flops():
        t0 = time.perf_counter()
        with Timed(model, input_fn, mesh, policy) as autop:
            entered_s = time.perf_counter() - t0
            autop.add_parameter_memory_constraint(low=None, high=min(1.0, memory_budget / state))
            autop.add_input_constraints([batch])
            autop.add_output_constraints([batch])
            yield Session(autop, timings["trace_s"], entered_s - timings["trace_s"], get_named_param_nodes(autop.gm.graph))


def place(model: nn.Module, batch_shape: tuple[int, int], mesh: DeviceMesh, mp: Any, memory_budget: float,
          exported: bool = False) -> nn.Module:
    """Place a meta-device `model` on `mesh` with Meta's solver (see `session`). `exported`: the
    module will only run inside an AOTAutograd export of the step (`--compile.mode aot`)."""
    with session(model, batch_shape, mesh, mp, memory_budget) as s:
        placed = s.autop.apply_placement(_solved_once(s.autop))
        forward_graph = _forward_graph(s.autop) if exported else None
    sharded = [f"{fqn} {b.placements}" for fqn, b in placed.named_buffers()
               if isinstance(b, DTensor) and not all(p.is_replicate() for p in b.placements)]
    if sharded:
        raise ConfigError(f"autoparallel: Meta's solver sharded the buffer {sharded[0]}, which this trainer keeps whole on "
                          f"every rank; use --compile.autoparallel_impl builtin for this model")
    # The placed forward fetches parameters with `get_parameter`, which refuses anything but an
    # nn.Parameter in the slot (the traced step, train_step.swapped_tensors, puts DTensors there for one
    # call), and calls `.to_local()` on buffers, which `materialize` makes plain tensors. The placed
    # module's class is its own (made per placement), so only it reads its slots this way.
    cls = type(placed)
    cls.get_parameter = _parameter_in_slot
    if forward_graph is None:
        ranks = math.prod(n for n, name in zip(mesh.shape, mesh.mesh_dim_names) if name in DP_DIMS)
        inner = cls.forward
    else:
        # the derived backward is that of the sum of every rank's loss: tensor-parallel ranks
        # repeat their data-parallel group's loss, so all ranks count in the mean
        ranks, inner = math.prod(mesh.shape), forward_graph
    cls.forward = lambda module, *args, **kwargs: _MeanOverRanks.apply(inner(module, *args, **kwargs), 1.0 / ranks)
    cls.get_buffer = lambda module, target: DTensor.from_local(
        nn.Module.get_buffer(module, target), mesh, [Replicate()] * mesh.ndim, run_check=False)
    return placed


def _solved_once(autop: Any) -> Any:
    """Meta's solution for this rank: solved by rank 0 alone and sent to the others as its placements file
    (`save_placements`: each node's chosen layouts by node name; every rank traced the same graph, so
    `load_placements` finds the same nodes). The ranks then place alike even where the solver could pick
    between equal optima, and N ranks on one host do not solve N times over."""
    from ..parallel.compat import from_lead, is_lead_process, receiving_ranks

    optimizer = autop.sharding_optimizer
    solved: list[Any] = []
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "placements.json"

        def placements() -> str:
            t0 = time.perf_counter()
            solved.append(autop.optimize_placement())
            if not receiving_ranks():
                return ""
            optimizer.save_placements(path)
            logger.info(f"Meta's placement: solved on rank 0 in {time.perf_counter() - t0:.1f} s, sent to {receiving_ranks()} ranks")
            return path.read_text()

        text = from_lead(placements)
        if is_lead_process():
            return solved[0]
        path.write_text(text)
        return optimizer.load_placements(path)


def _forward_graph(autop: Any) -> Any:
    """A forward for the placed module that an enclosing AOTAutograd export can trace: Meta's placed
    forward calls its own compiled autograd function, whose ops reach the enclosing export's
    functional tensors below its functionalization ("Attempting to use FunctionalTensor on its own",
    torch 2.13). This one runs the forward half of Meta's placed joint graph (the local ops and
    functional collectives it chose) op by op, and the export derives the backward (each functional
    collective has its autograd formula: an all-gather's gradient is reduce-scattered). That backward
    is the derivative of the sum of the ranks' losses with each rank's copy of a replicated parameter
    as its own input: `_summed_grad` adds the copies' gradients."""
    from autoparallel.graph_passes.extract_forward import extract_forward_graph

    joint = autop.joint_with_descriptors
    metadata = joint._aot_state.fw_metadata
    gm = extract_forward_graph(autop.parallel_gm, metadata.num_forward_returns, len(metadata.input_info))
    params, buffers, out_spec = list(joint.params_spec), list(joint.buffers_spec), joint.out_spec

    def forward(module: nn.Module, *args: Any) -> Any:
        flat = [_summed_grad(module.get_parameter(f)) for f in params] + [module.get_buffer(f).to_local() for f in buffers]
        outs = torch.fx.Interpreter(gm).run(*flat, *torch.utils._pytree.tree_leaves(args))
        return torch.utils._pytree.tree_unflatten(list(outs), out_spec)

    return forward


def _summed_grad(param: DTensor) -> torch.Tensor:
    """The local tensor of `param`, whose gradient is summed over the mesh dims it is replicated on."""
    dims = [d for d, p in enumerate(param.placements) if p.is_replicate()]
    local = param.to_local()
    return _SumOverDims.apply(local, param.device_mesh, tuple(dims)) if dims else local


class _SumOverDims(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, mesh: DeviceMesh, dims: tuple[int, ...]) -> torch.Tensor:
        ctx.mesh, ctx.dims = mesh, dims
        return local.view_as(local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        from torch.distributed._functional_collectives import all_reduce

        for d in ctx.dims:
            grad = all_reduce(grad.contiguous(), "sum", (ctx.mesh, d))
        return grad, None, None


class _MeanOverRanks(torch.autograd.Function):
    """Meta's graph takes the gradient of its batch-sharded output as that of one loss summed over the
    data-parallel ranks; the trainer's loss is each rank's mean over its own tokens, and the step's
    loss is the mean of those: so the output's gradient is scaled by 1 / ranks on the way back (what
    SimpleFSDP's `Partial("avg")` does to the parameter gradients)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def _parameter_in_slot(module: nn.Module, target: str) -> torch.Tensor:
    owner, _, name = target.rpartition(".")
    return module.get_submodule(owner)._parameters[name]


def spec_of(placements: tuple[Any, ...]) -> list[str]:
    """DTensor placements as the built-in solver writes layouts: `S<dim>`, `R`, `P`."""
    return [f"S{p.dim}" if p.is_shard() else "R" if p.is_replicate() else "P" for p in placements]


def _placement(spec: str) -> Any:
    return Shard(int(spec[1:])) if spec.startswith("S") else Replicate()


def parameter_specs(s: Session, solution: dict[Any, Any]) -> dict[str, list[str]]:
    """Each parameter's storage layout in a solution of Meta's program, by FQN."""
    return {fqn: spec_of(solution[node].output_specs.placements) for fqn, node in s.param_nodes.items()}


def price(s: Session, solution: dict[Any, Any]) -> dict[str, float]:
    """Meta's cost model on a solution of its program: its objective's compute, communication and
    transition terms (its unit: microseconds; a transition is a count that breaks ties), and the
    per-rank bytes of parameters, gradients and Adam state in the solution's parameter layouts."""
    opt = s.optimizer
    cost = opt._compute_solution_cost(opt._to_concrete_solution(solution))
    memory = 0.0
    for node in s.param_nodes.values():
        spec = solution[node].output_specs
        shards = math.prod(n for p, n in zip(spec.placements, spec.mesh.shape) if p.is_shard())
        meta = spec.tensor_meta
        memory += math.prod(meta.shape) * state_bytes_per_element(meta.dtype.itemsize) / shards
    return {"compute_s": cost["compute"] * 1e-6, "communication_s": cost["comm"] * 1e-6,
            "transitions": cost["transition"], "objective_s": cost["total"] * 1e-6, "memory_per_rank_bytes": memory}


def solve_pinned(s: Session, specs: dict[str, list[str]]) -> dict[Any, Any]:
    """Meta's best solution with every parameter stored as `specs` says (another solver's plan) and
    without its parameter memory row (the other plan answers to its own budget): the price of that
    plan in Meta's model, where Meta still chooses the activations' layouts. Call after its own solve
    (which sets the objective). Solved by HiGHS: the same program's optimum, found much faster than
    by the CBC its own solve uses (NOTES.md)."""
    import pulp

    opt = s.optimizer
    opt.remove_constraints([n for n in ("memory_constraint_high", "memory_constraint_low") if n in opt.prob.constraints])
    for fqn, node in s.param_nodes.items():
        opt.add_node_constraint(node, tuple(_placement(p) for p in specs[fqn]), constraint_name="pinned_param")
    opt.prob.solve(pulp.HiGHS(msg=False))
    if opt.prob.status != pulp.LpStatusOptimal:
        raise ConfigError(f"plan --against meta: Meta's program with the built-in plan's parameter layouts pinned is "
                          f"{pulp.LpStatus[opt.prob.status]}; that plan cannot be priced in Meta's model")
    opt.selected_keys = [key for key, dv in opt.decision_vars.items() if round(dv.var.value() or 0) == 1]
    for root in list(opt.selected_keys):
        opt.selected_keys.extend(opt._root_to_linked.get(root, []))
    return opt._to_orig_solution(opt._extract_and_validate_solution())
