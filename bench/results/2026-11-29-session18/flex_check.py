"""old: a FlexAttention step decomposed whole, then cut (as at dee0c63); new: as committed."""
import dataclasses, sys
from graph_trainer.passes import inductor, registry
from graph_trainer.passes.block_compile import is_subgraph

if sys.argv.pop(1) == "old":
    new = inductor.inductor_decomposition

    def whole(gm, ctx):
        if any(is_subgraph(gm, n) for n in gm.graph.find_nodes(op="get_attr")):
            return inductor.decompose(gm, inductor.fake_inputs(gm, ctx))
        return new(gm, ctx)

    registry.PASSES["inductor_decomposition"] = dataclasses.replace(registry.PASSES["inductor_decomposition"], fn=whole)
from graph_trainer.cli import entry_point
sys.exit(entry_point())
