"""The training loop: build once, capture the step once, then step, log and checkpoint.

Which capture mode and which backend run the step is decided by registries; nothing below branches
on them. Rank 0 writes `metrics.jsonl`, `config.toml` and `placements.json` into `job.dump_folder`.

How a run ends: 0 when it finishes, or when SIGINT/SIGTERM stopped it after the current step (with
`--checkpoint.enable` a checkpoint of that step is saved first; a second signal stops at once).
Failures the user can act on print one line on stderr, no traceback, and exit with
2 (a checkpoint that cannot be loaded, validation data too small for one batch; with `--comm.mode fake`, a simulated rank that does not fit on
the GPU), 3 (a non-finite loss or gradient norm: nothing is saved
for that step, the last good checkpoint stays the latest) or 4 (a collective failed: a peer rank
died, or did not answer within `--comm.timeout_seconds`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from . import models
from .capture import CaptureContext, build_step, own_grad_norm
from .checkpoint import Checkpointer, CheckpointError, any_rank, state_shapes
from .clipping import clip_grad_norm_
from .config import ConfigError, JobConfig, to_toml
from .data.random_tokens import random_batch
from .defaults import for_record, resolve
from .errors import print_error
from .step_watchdog import StepWatchdog, group_timeout
from .losses import build_loss
from .data import TokenLoader, build_tokenizer, document_separator, read_documents
from .hf_checkpoint import load_initial, save_hf
from .metrics import MetricsLogger, process_age_s, reset_peak_memory
from .worker_processes import stop_early
from .metrics_writers import MetricWriters
from .optimizer import build_optimizer
from .profiling import StepProfiler
from .prediction import write_prediction
from .parallel import apply_activation_checkpointing
from .parallel.compat import init_fake_process_group, serial_gloo
from .parallel.links import probe as probe_links
from .parallel.fake_data import fill_collective_outputs, restore_collectives, tokens_in_vocab_shard
from .parallel.materialize import materialize
from .parallel.mesh import Meshes, build_meshes, device_type, resolve_degrees
from .parallel.pipeline import forward_batch, layout_of, microbatches_of, prune_to_rank
from .parallel.vocab_embedding import VocabShardedEmbedding
from .pipelining import Pipeline
from .parallel.simple_fsdp import MixedPrecision
from .placement import place_model, write_placements
from .blocks import annotate_blocks
from .regions import annotate_regions
from .validation import Validator, build_forward, hold_out, validation_loader
from .passes.registry import run_teardowns

logger = logging.getLogger("graph_trainer")



class NonFiniteError(RuntimeError):
    """The loss or the gradient norm stopped being finite."""


_EXIT_CHECKPOINT, _EXIT_NON_FINITE, _EXIT_COMM = 2, 3, 4
_EXIT_DOES_NOT_FIT = 2


class StopSignals:
    """SIGINT and SIGTERM ask the loop to stop after the current step; a second one acts at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: str | None = None
        self.previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: object) -> None:
        if self.received is not None:
            self.__exit__()
            signal.raise_signal(signum)
        self.received = signal.Signals(signum).name

    def __enter__(self) -> "StopSignals":
        # Handlers can only be installed from the main thread; elsewhere signals keep their defaults.
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous = {}


def inject_test_faults(rank: int, step: int, model: torch.nn.Module) -> None:
    """Test-only faults read from the environment, before a step runs: a NaN weight
    (`GRAPH_TRAINER_INJECT_NAN_AT_STEP=STEP`), or a signal this process sends itself
    (`GRAPH_TRAINER_SIGNAL_AT_STEP=STEP:SIGNAME[:RANK]`)."""
    if os.environ.get("GRAPH_TRAINER_INJECT_NAN_AT_STEP") == str(step):
        with torch.no_grad():
            next(model.parameters()).to_local().fill_(float("nan"))
    at, _, rest = os.environ.get("GRAPH_TRAINER_SIGNAL_AT_STEP", "").partition(":")
    name, _, only_rank = rest.partition(":")
    if at == str(step) and only_rank in ("", str(rank)):
        os.kill(os.getpid(), signal.Signals[name])


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int

    @staticmethod
    def from_environ() -> "DistEnv":
        return DistEnv(int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))

    @staticmethod
    def simulated(cfg: JobConfig) -> "DistEnv":
        """This process's place in the job: from torchrun's environment, or the rank a fake run simulates."""
        if cfg.comm.mode == "fake":
            return DistEnv(cfg.comm.fake_rank, 0, cfg.comm.fake_world_size)
        return DistEnv.from_environ()


def init_distributed(env: DistEnv, device: torch.device, timeout_s: int, fake: bool = False) -> None:
    if fake:
        init_fake_process_group(env.world_size, env.rank)
        fill_collective_outputs()
        return
    backend = "nccl" if device.type == "cuda" else serial_gloo()
    timeout = group_timeout(timeout_s)
    if env.world_size == 1 and "MASTER_ADDR" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)


def set_determinism(cfg: JobConfig, device: torch.device) -> None:
    torch.manual_seed(cfg.training.seed)
    if cfg.training.deterministic:
        if device.type == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            # cuDNN attention's backward is non-deterministic even in deterministic mode (it only warns);
            # the model's own SDPA modules are switched in GraphTrainer (models.drop_cudnn_attention).
            torch.backends.cuda.enable_cudnn_sdp(False)
        # warn_only would keep the fast kernels of ops that have a deterministic variant too: flash and
        # memory-efficient attention pick their deterministic backward only when warnings are errors.
        torch.use_deterministic_algorithms(True, warn_only=device.type == "cpu")


class GraphTrainer:
    def __init__(self, cfg: JobConfig):
        started = time.perf_counter()
        before_init = process_age_s()
        self.env = DistEnv.simulated(cfg)
        cfg = resolve(cfg, device_type(), self.env.world_size)
        self.cfg = cfg
        self.fake = cfg.comm.mode == "fake"
        self.device = torch.device(f"cuda:{self.env.local_rank}") if device_type() == "cuda" else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # A fake run's one process writes the run's files whichever rank it simulates.
        self.is_rank0 = self.env.rank == 0 or self.fake
        init_distributed(self.env, self.device, cfg.comm.timeout_seconds, self.fake)
        set_determinism(cfg, self.device)
        t = cfg.training
        p = cfg.parallelism
        self.degrees = resolve_degrees(p.dp_replicate, p.dp_shard, p.tp, p.ep, self.env.world_size, p.pp)
        self.meshes: Meshes = build_meshes(self.degrees, self.device.type)
        probe_links(self.meshes, self.device)
        # with pipelining the loader reads one schedule microbatch at a time, as gradient accumulation would
        self.microbatches = microbatches_of(p)
        self.local_batch = forward_batch(t, p, self.degrees.dp)

        self.tokenizer = build_tokenizer(cfg.model.tokenizer_path or None)
        self.loader = None
        held_out: list[str] = []
        if not t.random_tokens:
            documents = read_documents(t.dataset_path or None)
            documents, held_out = hold_out(documents, cfg.validation.split)
            self.loader = TokenLoader(documents, self.tokenizer, t.seq_len, self.local_batch, self.meshes.dp_rank(), self.degrees.dp)

        spec = models.get_spec(cfg.model.name)
        args = spec.job_args(cfg, self.tokenizer)
        reference = models.build_on_meta(spec, args, self.device.type, models.stored_dtype(cfg))
        mp = MixedPrecision.from_config(cfg.training, self.device.type)
        placement_start = time.perf_counter()
        build = functools.partial(models.build_to_place, spec, args, self.device.type, document_separator(self.tokenizer),
                                  models.stored_dtype(cfg))
        model = build()
        layout = layout_of(cfg.parallelism, args.n_layers, lambda: models.stage_costs(args, reference, t.seq_len))
        if layout is not None:
            prune_to_rank(model, layout, self.meshes.pp.get_local_rank())
        self.model = place_model(model, spec, args, self.meshes, mp, cfg, layout, build)
        placement_s = time.perf_counter() - placement_start
        if t.deterministic and self.device.type == "cuda":
            models.drop_cudnn_attention(self.model)
        annotate_regions(self.model)
        annotate_blocks(self.model)
        materialize(self.model, reference, self.device, t.seed)
        # the stored parameter: reading the module attribute would gather it (SimpleFSDP)
        self.embedding_weight = dict(self.model.named_parameters()).get("tok_embeddings.weight") if self.fake else None
        self.vocab_dims = ("tp", "dp_shard") if isinstance(getattr(self.model, "tok_embeddings", None), VocabShardedEmbedding) else ("tp",)
        apply_activation_checkpointing(self.model, cfg)
        self.nparams, self.flops_per_token = models.nparams_and_flops_per_token(args, reference, t.seq_len)
        self.optimizers, self.lr_schedulers = build_optimizer(self.model, cfg, self.device, t.steps)
        self.load_balancing = None
        if spec.is_moe:
            from .parallel.expert_parallel import install_load_balancing

            self.load_balancing = install_load_balancing(self.optimizers, self.model, self.meshes)
        self.is_moe = spec.is_moe

        self.step = 0
        from torchtitan.components.checkpoint import ModelWrapper

        state = {"model": ModelWrapper(self.model), "optimizer": self.optimizers, "lr_scheduler": self.lr_schedulers, "train": self}
        describe = {"model": f"{cfg.model.name} {cfg.model.flavor} n_layers={args.n_layers}", "params": state_shapes(reference.state_dict()),
                    "seq_len": t.seq_len, "random_tokens": t.random_tokens, "mesh": str(self.degrees), "mode": cfg.compile.mode}
        self.checkpointer = Checkpointer(cfg, state, describe, self.device)
        if self.checkpointer.load() is None and cfg.checkpoint.initial_load_path:
            load_initial(self.model, spec, args, Path(cfg.checkpoint.initial_load_path), cfg.checkpoint.initial_load_in_hf)

        loss_fn = build_loss(t.loss, self.model, t.loss_chunk_tokens)
        stats = {"placement_s": placement_s} if before_init is None else {"placement_s": placement_s, "before_init_s": before_init}
        self.capture = CaptureContext(cfg, self.meshes, self.model, loss_fn, 1.0 / t.gradient_accumulation_steps, self.device,
                                      stats=stats, optimizers=self.optimizers)
        self.pipeline = None
        if layout is not None:
            self.pipeline = Pipeline(self.capture, layout, args, self.local_batch, mp.param_dtype)
            self.step_fn = self.pipeline.step
        else:
            self.step_fn = build_step(cfg.compile.mode, self.capture)
        self.validator = None
        if cfg.validation.enable:
            loader = validation_loader(cfg, held_out, self.tokenizer, self.local_batch, self.meshes.dp_rank(), self.degrees.dp)
            forward = build_forward(cfg, self.meshes, self.model, loss_fn, self.device)
            self.validator = Validator(cfg, loader, forward, self.model, self.device, self.to_device, self._mean_over_dp)
        if self.is_rank0:
            Path(cfg.job.dump_folder).mkdir(parents=True, exist_ok=True)
            (Path(cfg.job.dump_folder) / "config.toml").write_text(to_toml(for_record(cfg)))
            write_placements(self.model, cfg.job.dump_folder)
            logger.info(
                f"{cfg.model.name} {cfg.model.flavor}: {self.nparams:,} parameters, mesh {self.degrees}, "
                f"mode {cfg.compile.mode}, backend {cfg.compile.inductor_compilation}, device {self.device}"
            )
            if self.fake:
                logger.info(f"fake communication: rank {self.env.rank} of {self.env.world_size} on one device; shapes, memory and "
                            "compute are that rank's, collectives move no data, so losses and grad norms are not meaningful")
        # start-up before the first step: meshes, link probe, model init, optimizer, checkpoint load
        self.capture.stats["init_s"] = time.perf_counter() - started

    def state_dict(self) -> dict:
        """What a checkpoint holds besides model, optimizer and LR schedule: step, data position, RNG."""
        state = {"step": self.step, "rng": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        if self.loader is not None:
            state["loader"] = self.loader.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        torch.set_rng_state(state["rng"])
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        if self.loader is not None:
            # The saved position counts global samples; re-derive it for this run's data-parallel degree.
            local = {"local_batch_size": self.loader.local_batch_size, "dp_degree": self.loader.dp_degree}
            self.loader.load_state_dict({**state["loader"], **local})

    def next_batch(self, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cfg.training.random_tokens:
            inputs, labels = random_batch(self.cfg.training.seed, self.step, micro, self.meshes.dp_rank(),
                                          self.local_batch, self.cfg.training.seq_len, self.model.model_args.vocab_size)
        else:
            inputs, labels = self.loader.next_batch()
        return self.to_device(inputs, labels)

    def next_batches(self, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A gradient-accumulation microbatch: with pipelining, the schedule's microbatches read one by
        one (numbered as gradient accumulation numbers them) and joined for the schedule to split again."""
        if self.microbatches == 1:
            return self.next_batch(micro)
        parts = [self.next_batch(micro * self.microbatches + m) for m in range(self.microbatches)]
        return torch.cat([i for i, _ in parts]), torch.cat([lab for _, lab in parts])

    def to_device(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.embedding_weight is not None:
            # the fake reduce-scatter of a vocab-parallel embedding fills only this rank's rows (fake_data)
            inputs = tokens_in_vocab_shard(inputs, self.embedding_weight, self.vocab_dims)
        return inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)

    def train_step(self) -> tuple[float, float, dict]:
        """One optimizer step: microbatches through the captured step, clip, update. Returns the
        global loss, the gradient norm and, for MoE models, `dropped_tokens`."""
        self.optimizers.zero_grad()
        loss = torch.zeros((), device=self.device)
        for micro in range(self.cfg.training.gradient_accumulation_steps):
            inputs, labels = self.next_batches(micro)
            loss += self.step_fn(inputs, labels)
        started = time.perf_counter()
        grad_norm = own_grad_norm(self.step_fn)
        if grad_norm is None:
            grad_norm = clip_grad_norm_(list(self.model.parameters()), self.cfg.training.max_norm or math.inf,
                                        ep_enabled=self.degrees.ep > 1,
                                        norm_fn=self.pipeline.total_norm if self.pipeline is not None else None)
        # After a step that updated the parameters itself no gradient is left: AdamW skips every
        # parameter and only the optimizer's step hooks run (MoE load balancing).
        self.optimizers.step()
        self.lr_schedulers.step()
        # the first step's host time of clipping and the update (it was seconds through DTensor's dispatch)
        self.capture.stats.setdefault("optimizer_s", time.perf_counter() - started)
        values = [self._mean_over_dp(loss), grad_norm]
        dropped = self.load_balancing.dropped if self.load_balancing is not None else None
        if self.pipeline is not None and self.is_moe:
            # every pipeline rank joins the sum, one whose stages hold no MoE block too
            dropped = self.pipeline.sum_over_ranks(dropped)
        if dropped is not None:
            values.append(dropped)
        # One host sync per step reads all of them.
        loss, grad_norm, *dropped = torch.stack([v.double() for v in values]).tolist()
        return loss, grad_norm, {"dropped_tokens": int(dropped[0])} if dropped else {}

    def _mean_over_dp(self, loss: torch.Tensor) -> torch.Tensor:
        """The global batch's loss: every data-parallel rank holds the mean over its own share."""
        for dim in ("dp_replicate", "dp_shard"):
            if self.meshes.dense.size(self.meshes.dense.mesh_dim_names.index(dim)) > 1:
                dist.all_reduce(loss, group=self.meshes.dense.get_group(dim))
        return loss / self.degrees.dp

    def train(self) -> list[dict]:
        t = self.cfg.training
        tokens_per_step = self.local_batch * t.seq_len * t.gradient_accumulation_steps * self.microbatches
        metrics = MetricsLogger(self.cfg.job.dump_folder, self.is_rank0, t.steps, self.flops_per_token,
                                self.device, self.env.world_size, self.cfg.metrics.progress_bar, first_step=self.step + 1,
                                ranks_per_batch_shard=self.degrees.world_size // self.degrees.dp)
        p = self.cfg.profiling
        profiler = StepProfiler(self.cfg.job.dump_folder, p.start_step, p.steps, self.device, self.is_rank0, p.enable,
                                p.memory_snapshot)
        writers = MetricWriters(self.cfg, self.is_rank0)
        records = []
        start = time.perf_counter()
        first = True
        watchdog = StepWatchdog(self.cfg.comm.timeout_seconds, lambda step: comm_failure(
            self.cfg, f"at step {step}", f"not finished after {self.cfg.comm.timeout_seconds} s"), _EXIT_COMM)
        with StopSignals() as signals:
            while self.step < t.steps:
                self.step += 1
                inject_test_faults(self.env.rank, self.step, self.model)
                reset_peak_memory(self.device)
                profiler.before_step(self.step)
                # The scheduler steps at the end of train_step: read afterwards, this would be the next step's LR.
                lr = self.lr_schedulers.schedulers[0].get_last_lr()[0]
                # The first step compiles: no deadline then (a collective there still times out).
                with watchdog.step(self.step) if not first else contextlib.nullcontext():
                    loss, grad_norm, step_counts = self.train_step()
                profiler.after_step(self.step)
                if not self.fake and not (math.isfinite(loss) and math.isfinite(grad_norm)):
                    raise NonFiniteError(f"step {self.step}: loss {loss} / grad norm {grad_norm} is not finite; lower --optimizer.lr or check the data")
                extra = {"retraces": self.capture.stats.get("retraces", 0), "comm_mode": self.cfg.comm.mode, **step_counts}
                if profiler.covers(self.step):
                    extra["profiled"] = True
                if first:
                    extra["time_to_first_step_s"] = time.perf_counter() - start
                    # compile workers started early for a compile that took none of them
                    stop_early()
                    # every figure the capture and its passes reported (times, AC, schedule, compile cache)
                    extra.update({k: v for k, v in self.capture.stats.items() if isinstance(v, (int, float, str)) and k != "retraces"})
                    if self.is_rank0:
                        write_prediction(self.cfg.job.dump_folder, self.degrees.world_size, pipelined=self.pipeline is not None)
                    first = False
                validated = self.validator is not None and self.validator.due(self.step)
                if validated:
                    started = time.perf_counter()
                    extra.update(self.validator.run())
                    metrics.exclude(time.perf_counter() - started)
                if validated or self.step % self.cfg.metrics.log_freq == 0 or self.step == t.steps:
                    records.append(metrics.log(self.step, loss, grad_norm, lr, tokens_per_step, extra))
                    writers.write(records[-1])
                stop = any_rank(signals.received is not None, self.device)
                if self.checkpointer.due(self.step, stop):
                    self.checkpointer.save(self.step)
                metrics.restart_clock()
                if stop:
                    if self.is_rank0:
                        logger.warning(f"stopped after step {self.step} on a stop signal ({signals.received or 'sent to another rank'})")
                    break
        metrics.close()
        writers.close()
        if self.cfg.checkpoint.last_save_in_hf:
            spec = models.get_spec(self.cfg.model.name)
            save_hf(self.model, spec, self.model.model_args, self.cfg.model.flavor, self.checkpointer.root / f"step-{self.step}-hf")
        return records


def _is_comm_failure(e: BaseException) -> bool:
    """Gloo reports a dead or silent peer as a plain RuntimeError raised from its sources."""
    return isinstance(e, dist.DistError) or "gloo/" in str(e)


def comm_failure(cfg: JobConfig, where: str, why: str) -> str:
    return (f"a collective failed {where} ({why}); a peer rank died or did not answer within "
            f"--comm.timeout_seconds={cfg.comm.timeout_seconds}: see its log")


def _fail(message: str, code: int) -> NoReturn:
    print_error(message)
    raise SystemExit(code)


_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def does_not_fit(cfg: JobConfig, oom_message: str) -> str:
    """The one line for a simulated rank that ran out of GPU memory: what it needed (the allocator's
    reserved bytes plus the allocation that failed, as the OOM message states it) and what the device has."""
    asked = re.search(r"Tried to allocate ([0-9.]+) ([KMGT]?i?B)", oom_message)
    requested = float(asked.group(1)) * _UNITS[asked.group(2)] if asked else 0.0
    device = torch.cuda.current_device()
    needed = torch.cuda.memory_reserved(device) + requested
    total = torch.cuda.get_device_properties(device).total_memory
    c = cfg.comm
    return (f"rank {c.fake_rank} of {c.fake_world_size} does not fit on one GPU: it needed at least {needed / 2**30:.1f} GiB, "
            f"the device has {total / 2**30:.1f} GiB; shard more (larger --comm.fake_world_size and degrees), use "
            "--activation_checkpoint.mode full or a smaller --training.batch_size / --training.seq_len")


def run(cfg: JobConfig) -> list[dict]:
    """Train; a failure the user can act on ends the process with one line and an exit code (see above)."""
    trainer = None
    try:
        trainer = GraphTrainer(cfg)
        return trainer.train()
    except (CheckpointError, ConfigError) as e:
        _fail(str(e), _EXIT_CHECKPOINT)
    except NonFiniteError as e:
        _fail(str(e), _EXIT_NON_FINITE)
    except torch.cuda.OutOfMemoryError as e:
        if cfg.comm.mode != "fake":
            raise
        _fail(does_not_fit(cfg, str(e)), _EXIT_DOES_NOT_FIT)
    except RuntimeError as e:
        if not _is_comm_failure(e):
            raise
        where = f"at step {trainer.step}" if trainer is not None else "during start-up"
        _fail(comm_failure(cfg, where, str(e).strip().splitlines()[0]), _EXIT_COMM)
    finally:
        run_teardowns()
        restore_collectives()
        if dist.is_initialized():
            dist.destroy_process_group()
