"""A torchtitan 0.2.2 train spec for the benchmarks, loaded with `--experimental.custom_import
bench.titan_spec`: llama3 with our `1B` flavor (`--model.name gt_llama3`, and its SimpleFSDP experiment as
`gt_simple_fsdp_llama3`) and torchtitan's DeepSeek V3 (`gt_deepseek_v3`, its own flavors), fed the same random tokens graph-trainer's `--training.random_tokens` gives
(graph_trainer.data.random_tokens).

Under `--comm.mode fake_backend` torchtitan's functional collectives (DTensor's TP and EP) get the
kernels graph-trainer's fake mode uses (graph_trainer.parallel.fake_data), so neither side's step goes
NaN on stale collective outputs (NaN GEMMs run faster: bench/fake_data_check.py). FSDP2's
reduce-scatter calls the process group directly and keeps torch's behaviour."""

from __future__ import annotations

import dataclasses
import sys

from torchtitan.components.dataloader import BaseDataLoader
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


def _same_model_and_tokens(spec):
    flavors = models.get_spec("llama3").flavors
    # 70B cut to 8 layers, as graph-trainer's `--model.flavor 70B --model.n_layers 8` (bench/run.py's ScaleConfig.layers)
    cut = {"70B-8L": dataclasses.replace(flavors["70B"], n_layers=8)}
    return dataclasses.replace(spec, model_args={**flavors, **cut}, build_dataloader_fn=_build_dataloader)


register_train_spec("gt_llama3", _same_model_and_tokens(get_train_spec()))
register_train_spec("gt_simple_fsdp_llama3", _same_model_and_tokens(get_simple_fsdp_train_spec()))
register_train_spec("gt_deepseek_v3", dataclasses.replace(get_deepseek_v3_train_spec(), build_dataloader_fn=_build_dataloader))

# the flag is read here, before torchtitan parses its config: this module is imported while it does
if "fake_backend" in sys.argv:
    fill_collective_outputs()
