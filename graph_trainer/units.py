"""Byte units, one home for the whole package, and memory sizes as the flags give them."""

import re

from .config import ConfigError

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def half_of(device_memory: float) -> float:
    return 0.5 * device_memory


DEVICE_MARGIN_BYTES = 4 * GiB
DEVICE_MARGIN_SHARE = 0.08
"""What a budget that fills the device leaves free: the caching allocator's fragmentation (reserved
above active: 2-10 GiB in the project's 8B and 70B runs), NCCL's buffers (a few hundred MiB per
communicator) and the CUDA context; the larger of 4 GiB and 8% of the device."""


def fill_device(device_memory: float) -> float:
    """The device's memory less the margin: 72.8 GiB of an H100's 79.1, 128.6 GiB of an H200's 139.8."""
    return device_memory - max(DEVICE_MARGIN_BYTES, DEVICE_MARGIN_SHARE * device_memory)


def parse_memory_budget(text: str, device_memory: float, flag: str = "compile.autoparallel_memory_budget",
                        when_empty=half_of) -> float:
    """'' -> `when_empty(device memory)` (half of it unless told); '0.5' -> a fraction; '20GiB' /
    '512MiB'. `flag` names the setting in errors."""
    text = text.strip()
    if not text:
        return when_empty(device_memory)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(GiB|GB|MiB|MB)?", text)
    if not m:
        raise ConfigError(f"{flag} {text!r} is not a fraction (0.5) or a size (20GiB, 512MiB)")
    value, unit = float(m.group(1)), m.group(2)
    if unit is None:
        if not 0 < value <= 1:
            raise ConfigError(f"{flag} {text!r}: a fraction of device memory must be in (0, 1]; use e.g. 0.5 or 20GiB")
        return value * device_memory
    return value * {"GiB": GiB, "GB": 1e9, "MiB": MiB, "MB": 1e6}[unit]
