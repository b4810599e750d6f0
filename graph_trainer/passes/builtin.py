"""Imports every shipped pass module so that each registers itself (one import per module)."""

from . import cudagraph  # noqa: F401
from . import inductor  # noqa: F401
from . import bucketing, block_bucketing, reshard  # noqa: F401
from . import memory_policy  # noqa: F401
