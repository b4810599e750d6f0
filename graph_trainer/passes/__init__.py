"""Graph passes. `registry.py` knows no pass: each pass module registers itself on import, and this
package imports them all (as `graph_trainer.backends` does its backends), so importing anything from
`graph_trainer.passes` fills the registry."""

from . import cudagraph  # noqa: F401
from . import inductor  # noqa: F401
from . import bucketing, block_bucketing, gather_group, reshard  # noqa: F401
from . import checkpoint_tags, memory_policy, pointwise_recompute  # noqa: F401
from . import async_tp, ep_overlap, tp_reduce_overlap  # noqa: F401
