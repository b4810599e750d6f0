"""A torchtitan 0.2.2 train spec for the benchmarks, loaded with `--experimental.custom_import
bench.titan_spec`: llama3 with our `1B` flavor (`--model.name gt_llama3`, and its SimpleFSDP experiment as
`gt_simple_fsdp_llama3`) and torchtitan's DeepSeek V3 (`gt_deepseek_v3`, its own flavors), each also cut to fewer
layers as graph-trainer's `--model.n_layers` cuts them (`8B-16L`, `70B-8L`, `16B-6L`, `16B-12L`), fed the same random
tokens graph-trainer's `--training.random_tokens` gives (graph_trainer.data.random_tokens).

Every logged step, rank 0 appends its peak active and reserved bytes to `<dump_folder>/titan_memory.jsonl`
(bench/runner.py reads it): torchtitan's log line gives reserved bytes only, and graph-trainer reports active ones.

Under `--comm.mode fake_backend` torchtitan's functional collectives (DTensor's TP and EP) get the
kernels graph-trainer's fake mode uses (graph_trainer.parallel.fake_data), so neither side's step goes
NaN on stale collective outputs (NaN GEMMs run faster: bench/fake_data_check.py). FSDP2's
reduce-scatter calls the process group directly and keeps torch's behaviour."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch.distributed as dist
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.experiments.simple_fsdp.llama3 import get_train_spec as get_simple_fsdp_train_spec
from torchtitan.models.deepseek_v3 import get_train_spec as get_deepseek_v3_train_spec
from torchtitan.models.llama3 import get_train_spec
from torchtitan.protocols.train_spec import get_train_spec as registered_spec
from torchtitan.protocols.train_spec import register_train_spec

from graph_trainer import models
from graph_trainer.data.random_tokens import random_batch
from graph_trainer.parallel.fake_data import fill_collective_outputs


class SameTokens(BaseDataLoader):
    def __init__(self, dp_rank: int, local_batch: int, seq_len: int, vocab_size: int, seed: int):
        self.dp_rank, self.local_batch, self.seq_len, self.vocab_size, self.seed = dp_rank, local_batch, seq_len, vocab_size, seed
        self.step = 0

    def __iter__(self):
        while True:
            self.step += 1
            inputs, labels = random_batch(self.seed, self.step, 0, self.dp_rank, self.local_batch, self.seq_len, self.vocab_size)
            yield {"input": inputs}, labels

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def _build_dataloader(dp_world_size, dp_rank, tokenizer, job_config, infinite=True):
    flavor = registered_spec(job_config.model.name).model_args[job_config.model.flavor]
    return SameTokens(dp_rank, job_config.training.local_batch_size, job_config.training.seq_len, flavor.vocab_size,
                      job_config.debug.seed or 0)


class ActivePeak(MetricsProcessor):
    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        # read before torchtitan's log, which resets the peaks
        peak = self.device_memory_monitor.get_peak_stats()
        if not dist.is_initialized() or dist.get_rank() == 0:
            with (Path(self.job_config.job.dump_folder) / "titan_memory.jsonl").open("a") as f:
                f.write(json.dumps({"step": step, "active_peak_gib": peak.max_active_gib, "reserved_peak_gib": peak.max_reserved_gib}) + "\n")
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)


def _build_metrics_processor(job_config, parallel_dims, model_args=None, tag=None):
    return ActivePeak(job_config, parallel_dims, tag)


def _cut(flavors: dict, cuts: list[tuple[str, int]]) -> dict:
    """`<flavor>-<n>L`: the flavor with n layers, as graph-trainer's `--model.flavor F --model.n_layers n`."""
    return {**flavors, **{f"{name}-{n}L": dataclasses.replace(flavors[name], n_layers=n) for name, n in cuts}}


def _same_model_and_tokens(spec, flavors: dict):
    return dataclasses.replace(spec, model_args=flavors, build_dataloader_fn=_build_dataloader,
                               build_metrics_processor_fn=_build_metrics_processor)


# the scale suite's 70B-8L, the multi suite's 8B-16L, 16B-6L (2 GPUs) and 16B-12L (4 GPUs)
LLAMA3 = _cut(models.get_spec("llama3").flavors, [("70B", 8), ("8B", 16)])
register_train_spec("gt_llama3", _same_model_and_tokens(get_train_spec(), LLAMA3))
register_train_spec("gt_simple_fsdp_llama3", _same_model_and_tokens(get_simple_fsdp_train_spec(), LLAMA3))
deepseek_v3 = get_deepseek_v3_train_spec()
register_train_spec("gt_deepseek_v3", _same_model_and_tokens(deepseek_v3, _cut(deepseek_v3.model_args, [("16B", 6), ("16B", 12)])))

# the flag is read here, before torchtitan parses its config: this module is imported while it does
if "fake_backend" in sys.argv:
    fill_collective_outputs()
