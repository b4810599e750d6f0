"""The devices and links the cost models price work on: one `Hardware` for the solver, the
collective scheduling passes and the run's prediction file.

Spec sheets (dense, no sparsity), and what we take as reachable:
- H100 SXM: 989 TFLOP/s bf16/fp16 on the tensor cores, 67 TFLOP/s fp32 (CUDA cores; torch leaves
  TF32 matmuls off), 3.35 TB/s HBM3, 80 GB. H200: the same chip with 4.8 TB/s HBM3e and 141 GB.
  70% of the peaks is reachable (AutoParallel's and torch's roofline estimators use 0.7; the project
  measured 729-798 TFLOP/s for a bf16 8192^3 matmul, 74-81%).
- NVLink 4 inside an 8-GPU HGX node: 900 GB/s per GPU both directions together, 450 GB/s per
  direction; NCCL rings reach about 80% of it, so 360 GB/s is used. Between nodes one 400 Gb/s NDR
  InfiniBand NIC per GPU: 50 GB/s, 40 GB/s used. Latency per ring step 10 us (NVLink) and 20 us (IB).
- The host spends `launch_s` per kernel (Python, dispatcher, launch), which is what small models are
  bound by; the GPU runs a kernel once it is launched and the previous one is done, so a kernel
  behind a long one launches while that one runs (passes/cost_model.py, `graph_times`). H100 (and
  H200, same hosts): 58 us, the figure at which the price of llama3 debug (8 x 2048 tokens, one GPU,
  aot_fx_trace without Inductor: one kernel per aten op) equals its measured step, 27.5 ms
  (bench/results/2026-11-23-h100-parts/1-bitwise-debug-deepseek.json), where the roofline alone gives
  6.0 ms for its 477 kernels: launch-bound throughout, so whether host and GPU overlap barely
  changes the figure (the traced llama3 debug step: 44.0 ms priced kernel by kernel, 43.3 ms
  overlapped). It includes the trainer's per-step work spread over the kernels, so it is an upper
  figure per kernel; Inductor's generated code launches its fused kernels with less host work per
  kernel, which this figure does not separate.
- Host link (activation offload): PCIe Gen5 x16 between the GPU and its host, 64 GB/s per direction
  on the spec sheet, each direction usable at once. 128b/130b encoding and packet headers leave about
  80% of it for data (pinned-memory copies are commonly reported at 50-55 GB/s on H100 hosts; not
  measured by this project), and the NIC of a node may share the CPU's root complex: we take the same
  0.7 as for every other rate, 45 GB/s. A copy also costs a launch (`launch_s`).
- A collective that overlaps compute (an FSDP bucket issued ahead of its use) takes `collective_slowdown_s` more
  than the link's latency-bandwidth time, and the compute beside it `compute_slowdown_s` more. On 2 H200s (llama3 8B
  cut to 16 layers, dp_shard 2, real NCCL) the step gathers 16.1 GB: 35.4 ms at the 227 GB/s the link probe
  measured on the idle device, plus its 12.7 us per collective. 35 per-block all-gather buckets took 44.9 ms of
  kernel time, 130 size-based buckets of the same bytes 72.4 ms: 0.26 and 0.27 ms more per collective. The GEMMs
  beside the 211 size-based buckets (all-gathers and reduce-scatters) took 313.8 ms, beside the 53 per-block ones
  303.7: 0.064 ms per collective (bench/results/2026-11-30-session24, calls 2 and 8). Not the link's latency (the
  probe's calls ran alone), so both are priced only where compute runs beside the collective. Priced, they make
  a size search choose fewer, larger buckets (that step: 29, the largest 2.8 GiB, where it chose 211 without them).
- CPU-gloo (the shared test machines, 2 ranks over loopback, one thread each): a 2-rank all-gather
  took 0.25 ms at 8 KB and moved 0.2-0.5 GB/s, fp32 mm ran at 23 GFLOP/s, copies at 2-4 GB/s.

The numbers are per device kind, never measured per run: every rank must derive the same schedule
(same collectives, same order) from the same graph, or the ranks deadlock.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping

import torch

from .units import GiB, MiB


@dataclass(frozen=True)
class Hardware:
    """One device kind and its links. Rates are spec-sheet peaks; `efficiency` of them is reached."""

    name: str = "h100"
    peak_flops: Mapping[torch.dtype, float] = dataclasses.field(
        default_factory=lambda: {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 67e12})
    """Matmul FLOP/s by dtype; dtypes not listed use the float32 figure."""
    hbm_bytes_per_s: float = 3.35e12
    efficiency: float = 0.7
    intra_node_bytes_per_s: float = 360e9
    """Bytes/s one rank moves around an NCCL ring inside a node."""
    inter_node_bytes_per_s: float = 40e9
    intra_latency_s: float = 10e-6
    """Seconds per ring step inside a node."""
    inter_latency_s: float = 20e-6
    launch_s: float = 58e-6
    """Host seconds per kernel launch (collectives included); one op priced alone costs max(roofline, this)."""
    collective_slowdown_s: float = 0.27e-3
    """Seconds a collective kernel takes longer when compute kernels run beside it than on an idle device, each
    collective alike whatever its size (its blocks wait for SMs the GEMMs hold; see the module docstring)."""
    compute_slowdown_s: float = 0.064e-3
    """Seconds the compute kernels that run beside one collective take longer in all (the SMs and memory
    bandwidth the collective takes)."""
    host_link_bytes_per_s: float = 64e9
    """Bytes/s each way between the device and pinned host memory; 0 where there is no such link (CPU)."""
    gpus_per_node: int = 8
    device_memory_bytes: float = 80 * GiB
    max_bucket_bytes: int = 1 * GiB
    max_in_flight_bytes: int = 5 * GiB
    """Gathered bytes that may be in flight (issued, not yet consumed) at once."""

    def flops(self, dtype: torch.dtype) -> float:
        """Reachable FLOP/s for matmuls in `dtype`."""
        return self.efficiency * self.peak_flops.get(dtype, self.peak_flops[torch.float32])

    @property
    def mem_bw(self) -> float:
        """Reachable HBM bytes/s."""
        return self.efficiency * self.hbm_bytes_per_s

    def link(self, inter_node: bool) -> tuple[float, float]:
        """(bytes/s, seconds per ring step) of a link inside a node or across nodes."""
        if inter_node:
            return self.inter_node_bytes_per_s, self.inter_latency_s
        return self.intra_node_bytes_per_s, self.intra_latency_s

    def host_transfer_s(self, nbytes: int) -> float:
        """Seconds to copy `nbytes` one way between device and pinned host memory (inf without a link)."""
        if self.host_link_bytes_per_s <= 0:
            return float("inf")
        return self.launch_s + nbytes / (self.efficiency * self.host_link_bytes_per_s)

    def describe(self) -> dict[str, float | str]:
        return {"hardware": self.name,
                "intra_node_GBps": self.intra_node_bytes_per_s / 1e9, "inter_node_GBps": self.inter_node_bytes_per_s / 1e9}


H100 = Hardware()
# memory: what torch reports as the H200's total (139.8 GiB, printed by the trainer's out-of-memory line on the
# device), not the spec sheet's 141 GB, so that a plan made on a CPU gets the budget the GPU run would
H200 = dataclasses.replace(H100, name="h200", hbm_bytes_per_s=4.8e12, device_memory_bytes=139.8 * GiB)
CPU_GLOO = Hardware(
    name="cpu",
    peak_flops={torch.float32: 25e9 / 0.7, torch.bfloat16: 8e9 / 0.7, torch.float16: 8e9 / 0.7},
    hbm_bytes_per_s=4e9 / 0.7,
    intra_node_bytes_per_s=0.5e9,
    inter_node_bytes_per_s=0.5e9,
    intra_latency_s=150e-6,
    inter_latency_s=150e-6,
    launch_s=30e-6,
    collective_slowdown_s=0.0,
    compute_slowdown_s=0.0,
    host_link_bytes_per_s=0.0,
    device_memory_bytes=24 * GiB,
    max_bucket_bytes=64 * MiB,
    max_in_flight_bytes=256 * MiB,
)
KINDS = {"h100": H100, "h200": H200, "cpu": CPU_GLOO}
CHOICES = ("auto", *KINDS)


def hardware_for(device: torch.device) -> Hardware:
    """The kind of the device a job runs on, with that GPU's own memory size; a GPU job planned where
    there is no GPU (`graph-trainer plan`) is priced as the H100."""
    if device.type != "cuda":
        return CPU_GLOO
    if not torch.cuda.is_available():
        return H100
    return _cuda_kind(torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device).total_memory)


@lru_cache(maxsize=None)
def _cuda_kind(name: str, total_memory: int) -> Hardware:
    return dataclasses.replace(H200 if "H200" in name else H100, device_memory_bytes=float(total_memory))


def select(choice: str, device: torch.device) -> Hardware:
    """`--compile.hardware`: a named kind, or `auto` for the device the job runs on. The one place
    the solver, the cost-model passes, the prediction file and `graph-trainer plan` get their numbers
    (and the device memory the memory budgets are fractions of) from."""
    return hardware_for(device) if choice == "auto" else KINDS[choice]


def ring_collective_s(kind: str, nbytes: float, ranks: int, bytes_per_s: float, step_latency_s: float,
                      latency_share: float = 1.0) -> float:
    """Seconds for one ring collective over `ranks` ranks; `nbytes` is the unsharded size (gathered
    output, reduce-scatter input, all-reduce tensor, all-to-all buffer). An all-reduce moves the bytes
    of a reduce-scatter and an all-gather, in one launch whose latency is one pass's (NCCL fuses it;
    small ones run as trees). `latency_share` < 1 prices a tensor that shares a bucket with others."""
    if ranks <= 1:
        return 0.0
    steps = ranks - 1
    passes = 2 if kind == "all_reduce" else 1
    return latency_share * steps * step_latency_s + passes * steps / ranks * nbytes / bytes_per_s


OPTIMIZER_BYTES_PER_ELEMENT = 28
"""AdamW step per element: read param, grad and two moments, write param and two moments (fp32)."""


def roofline_s(flops: float, nbytes: float, dtype: torch.dtype, hw: Hardware) -> float:
    """Seconds for work bound by the tensor cores or by memory, whichever is slower."""
    return max(flops / hw.flops(dtype), nbytes / hw.mem_bw)
