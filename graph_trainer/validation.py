"""Validation: the loss (and perplexity) on data the model does not train on, forward only.

The data is `--validation.dataset_path`, or the last `--validation.split` share of the training
documents, which the training loader then never gets (`hold_out`). Every `--validation.freq` steps
and at the last step, each rank runs `--validation.steps` batches of its data-parallel shard, always
from the start of the validation stream (so evaluations compare); the result is the mean loss over
those batches and over the data-parallel ranks, and its exponential (`validation_perplexity`).

How the forward runs follows the capture mode: aot_fx_trace traces model + loss under no_grad with
the train step's own tracer (on fake tensors) into a forward graph, which the job's backend compiles
with its passes that act on forward graphs; the other modes run the module's forward under no_grad.

The training state is left bit for bit as it was: nothing records gradients and no optimizer runs,
the training loader is another object, and the RNG states and the model's buffers (the MoE token
counters that load balancing reads before the optimizer step count every forward) are put back.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import fx, nn

from .config import ConfigError, JobConfig
from .data import TokenLoader
from .parallel.mesh import Meshes
from .parallel.simple_fsdp import direct_gathers
from .train_step import LossFn, named_buffers, param_specs, swapped_tensors

Batch = tuple[torch.Tensor, torch.Tensor]
Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def hold_out(documents: Sequence[str], split: float) -> tuple[Sequence[str], Sequence[str]]:
    """(training documents, held-out documents): the last `split` share (rounded up) is held out."""
    if split == 0:
        return documents, []
    held = math.ceil(split * len(documents))
    if held >= len(documents):
        raise ConfigError(f"validation.split={split} of {len(documents)} documents leaves none to train on; "
                          "lower --validation.split or use --validation.dataset_path")
    return documents[: len(documents) - held], documents[len(documents) - held :]


def validation_loader(cfg: JobConfig, held_out: Sequence[str], tokenizer: Any, local_batch: int, dp_rank: int, dp: int) -> TokenLoader:
    """Batches of the validation documents, shaped and sharded over the data-parallel ranks as the training ones."""
    from .data import read_documents

    path = cfg.validation.dataset_path
    documents = read_documents(path) if path else held_out
    try:
        return TokenLoader(documents, tokenizer, cfg.training.seq_len, local_batch, dp_rank, dp)
    except ValueError as e:
        where = f"--validation.dataset_path {path}" if path else f"the held-out share --validation.split={cfg.validation.split}"
        raise ConfigError(f"{where} is too small for validation ({e}); give it more documents") from None


class ModuleForward:
    """The model's own forward and the loss, under no_grad (eager, jit and aot)."""

    def __init__(self, model: nn.Module, loss_fn: LossFn):
        self.model, self.loss_fn = model, loss_fn

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), direct_gathers():
            return self.loss_fn(self.model(inputs), labels)


class _FunctionalForward:
    """Model + loss as a function of local parameter shards and buffers, shaped for `trace_train_step`
    (it returns the loss and no gradients)."""

    def __init__(self, model: nn.Module, loss_fn: LossFn):
        self.model, self.loss_fn = model, loss_fn
        self.specs = param_specs(model)
        self.buffer_names, _ = named_buffers(model)

    def __call__(self, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor], inputs: torch.Tensor,
                 labels: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        dparams = {s.fqn: s.wrap(p) for s, p in zip(self.specs, params)}
        with torch.no_grad(), swapped_tensors(self.model, {**dparams, **dict(zip(self.buffer_names, buffers))}):
            return self.loss_fn(self.model(inputs), labels), []


class TracedForward:
    """aot_fx_trace: the forward graph, traced on the first batch (and again for a batch of another shape)."""

    def __init__(self, cfg: JobConfig, meshes: Meshes, model: nn.Module, loss_fn: LossFn, device: torch.device):
        self.cfg, self.meshes, self.device = cfg, meshes, device
        self.fn = _FunctionalForward(model, loss_fn)
        self.params = [p for p in model.parameters() if p.requires_grad]
        _, self.buffers = named_buffers(model)
        self.compiled: Callable[..., Any] | None = None
        self.signature: tuple | None = None

    def _build(self, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        from graph_trainer.backends import get_backend

        from .capture.fx_trace import trace_train_step
        from .graph_dump import GraphDumper
        from .parallel.compat import is_lead_process
        from .passes.registry import PassContext, apply_passes

        cfg = self.cfg
        locals_ = [p.to_local() for p in self.params]
        gm: fx.GraphModule = trace_train_step(self.fn, locals_, self.buffers, inputs, labels, self.device)
        dumper = GraphDumper(f"{cfg.job.dump_folder}/graphs/validation" if cfg.compile.dump_graphs and is_lead_process() else None)
        dumper.dump("traced", gm)
        pctx = PassContext(cfg=cfg, meshes=self.meshes, device=self.device, example_inputs=[*locals_, *self.buffers, inputs, labels],
                           dumper=dumper, num_params=len(self.params), num_buffers=len(self.buffers),
                           param_fqns=[s.fqn for s in self.fn.specs])
        # The backend's own compile names the train-step stage, whose passes expect a backward (the
        # parameter and activation policies, cudagraph's static inputs); a forward graph gets the
        # backend's passes that declare the forward stage, as aot's forward graph does.
        names = get_backend(cfg.compile.inductor_compilation).pass_names(cfg.compile.passes)
        self.compiled = apply_passes(gm, names, pctx, "forward")
        self.signature = (tuple(inputs.shape), tuple(labels.shape))

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.signature != (tuple(inputs.shape), tuple(labels.shape)):
            self._build(inputs, labels)
        assert self.compiled is not None
        with torch.no_grad():
            (loss,) = self.compiled(*[p.to_local() for p in self.params], *self.buffers, inputs, labels)
        return loss


def build_forward(cfg: JobConfig, meshes: Meshes, model: nn.Module, loss_fn: LossFn, device: torch.device) -> Forward:
    if cfg.compile.mode == "aot_fx_trace":
        return TracedForward(cfg, meshes, model, loss_fn, device)
    return ModuleForward(model, loss_fn)


@contextlib.contextmanager
def training_state_kept(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Put back what a forward can change besides its output: the RNG states and the buffers."""
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    buffers = list(model.buffers())
    saved = [b.clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in zip(buffers, saved):
                b.copy_(value)
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng, device)


class Validator:
    """`run()` -> {"validation_loss", "validation_perplexity"}, the same figures on every rank.

    `to_device` prepares a loader batch as the training batches are (device, fake-communication
    token ids); `mean_over_dp` turns a rank's mean into the mean over the data-parallel ranks."""

    def __init__(self, cfg: JobConfig, loader: TokenLoader, forward: Forward, model: nn.Module, device: torch.device,
                 to_device: Callable[[torch.Tensor, torch.Tensor], Batch], mean_over_dp: Callable[[torch.Tensor], torch.Tensor]):
        self.freq, self.steps, self.last_step = cfg.validation.freq, cfg.validation.steps, cfg.training.steps
        self.loader, self.forward, self.model, self.device = loader, forward, model, device
        self.to_device, self.mean_over_dp = to_device, mean_over_dp
        self.start = loader.state_dict()

    def due(self, step: int) -> bool:
        return step % self.freq == 0 or step == self.last_step

    def run(self) -> dict[str, float]:
        self.loader.load_state_dict(self.start)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        with training_state_kept(self.model, self.device):
            for _ in range(self.steps):
                total += self.forward(*self.to_device(*self.loader.next_batch())).double()
        loss = self.mean_over_dp(total / self.steps).item()
        # exp overflows a double above ~709.8: such a loss means nothing has been learnt
        return {"validation_loss": loss, "validation_perplexity": math.exp(loss) if loss < 709 else math.inf}
