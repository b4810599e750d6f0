"""Model specs: torchtitan 0.2.2's Llama 3 and DeepSeek V3 definitions, imported, plus our flavors.

A spec says how to build a model on the meta device for a flavor; placement and materialisation
happen later (parallel/), so a 70B model never exists unsharded in host memory.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn


@dataclass(frozen=True)
class ModelSpec:
    name: str
    flavors: dict[str, Any]
    model_cls: type[nn.Module]
    is_moe: bool

    def args_for(self, flavor: str, seq_len: int, n_layers: int = 0) -> Any:
        args = copy.deepcopy(self.flavors[flavor])
        args.max_seq_len = seq_len
        if n_layers:
            args.n_layers = n_layers
        return args


def _llama3() -> ModelSpec:
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs, llama3_args

    flavors = dict(llama3_args)
    # Single-GPU benchmark size (1.43B with the 128K vocabulary): the baseline figures use it.
    flavors["1B"] = TransformerModelArgs(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
        ffn_dim_multiplier=1.3, multiple_of=1024, rope_theta=500000,
    )
    return ModelSpec("llama3", flavors, Transformer, is_moe=False)


def _deepseek_v3() -> ModelSpec:
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, deepseekv3_args

    flavors = {}
    for name, args in deepseekv3_args.items():
        args = copy.deepcopy(args)
        args.moe_impl = "standard"
        if name in ("16B", "236B", "671B"):
            # torchtitan gives these FlexAttention with document masks, which need a BlockMask per
            # batch; our step feeds packed sequences under one causal mask, which SDPA does.
            args.attn_type, args.attn_mask_type = "sdpa", "causal"
        flavors[name] = args
    return ModelSpec("deepseek_v3", flavors, DeepSeekV3Model, is_moe=True)


_BUILDERS: dict[str, Callable[[], ModelSpec]] = {"llama3": _llama3, "deepseek_v3": _deepseek_v3}
_CACHE: dict[str, ModelSpec] = {}


def model_names() -> list[str]:
    return list(_BUILDERS)


def get_spec(name: str) -> ModelSpec:
    if name not in _CACHE:
        _CACHE[name] = _BUILDERS[name]()
    return _CACHE[name]


def build_on_meta(spec: ModelSpec, args: Any, device_type: str) -> nn.Module:
    """Build the model with meta parameters; grouped GEMMs for MoE only where the GPU has them."""
    if spec.is_moe:
        args.moe_args.use_grouped_mm = device_type == "cuda" and torch.cuda.get_device_capability() >= (9, 0)
    with torch.device("meta"):
        return spec.model_cls(args)


def transformer_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """The repeated blocks by their FQN (`layers.0`, ...): the unit of bucketing, AC and solving."""
    return {f"layers.{k}": m for k, m in model.layers.items()}


def nparams_and_flops_per_token(args: Any, model: nn.Module, seq_len: int) -> tuple[int, int]:
    return args.get_nparams_and_flops(model, seq_len)


def describe(args: Any) -> dict[str, Any]:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if isinstance(getattr(args, f.name), (int, float, str))}
