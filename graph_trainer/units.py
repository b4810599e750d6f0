"""Byte units, one home for the whole package, and memory sizes as the flags give them."""

import re

from .config import ConfigError

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def parse_memory_budget(text: str, device_memory: float, flag: str = "compile.autoparallel_memory_budget") -> float:
    """'' -> half the device memory; '0.5' -> a fraction; '20GiB' / '512MiB'. `flag` names the setting
    in errors."""
    text = text.strip()
    if not text:
        return 0.5 * device_memory
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(GiB|GB|MiB|MB)?", text)
    if not m:
        raise ConfigError(f"{flag} {text!r} is not a fraction (0.5) or a size (20GiB, 512MiB)")
    value, unit = float(m.group(1)), m.group(2)
    if unit is None:
        if not 0 < value <= 1:
            raise ConfigError(f"{flag} {text!r}: a fraction of device memory must be in (0, 1]; use e.g. 0.5 or 20GiB")
        return value * device_memory
    return value * {"GiB": GiB, "GB": 1e9, "MiB": MiB, "MB": 1e6}[unit]
