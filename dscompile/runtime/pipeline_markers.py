"""``dscompile.pipeline_split()``: a marker call that tells the pipeline pass where to cut.

It is a registered ``torch.library`` custom op with no inputs, no outputs and no effect, flagged
as side-effecting so that Dynamo and FX dead-code elimination keep it in the captured graph.
The pipeline pass cuts the graph in front of every marker node and then removes the markers.
"""

from __future__ import annotations

import torch
import torch.fx


@torch.library.custom_op("dscompile::pipeline_split", mutates_args=())
def _pipeline_split_op() -> None:
    return None


@_pipeline_split_op.register_fake
def _pipeline_split_fake() -> None:
    return None


MARKER_TARGET = torch.ops.dscompile.pipeline_split.default
torch.fx.node.has_side_effect(MARKER_TARGET)


def pipeline_split() -> None:
    """Start a new pipeline stage here (inside ``forward``); a no-op when not pipelining."""
    torch.ops.dscompile.pipeline_split()


def is_marker(node: torch.fx.Node) -> bool:
    """True for the graph node a ``pipeline_split()`` call left behind."""
    return node.op == "call_function" and node.target in (MARKER_TARGET, torch.ops.dscompile.pipeline_split)
