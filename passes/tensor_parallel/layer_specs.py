"""``partition_config.layer_specs``: DeepSpeed's regexes over parameter names, checked against the graph's split.

The graph decides the split; a spec only narrows it (``skip``, ``use_default_specs: false``), and what it states
(role, fused parts, split dim, summed gradient) must agree with what the graph shows, else an error names the pattern.
"""

from __future__ import annotations

import re
from typing import Any

from dscompile.errors import DSCompileConfigError
from dscompile.passes.tensor_parallel.blocks import Block
from dscompile.passes.tensor_parallel.config import LayerSpec, PartitionConfig
from dscompile.runtime.tensor_parallel import SliceSpec


def _matching_spec(name: str, specs: list[LayerSpec], model_type: str | None = None) -> tuple[LayerSpec, str] | None:
    """The first spec (for this model type) with a pattern that matches ``name``, and that pattern."""
    for spec in specs:
        if spec.model_types is not None and model_type not in spec.model_types:
            continue
        for pattern in spec.patterns:
            if re.search(pattern, name):
                return spec, pattern
    return None


def _spec_for(name: str, specs: list[LayerSpec], model_type: str | None = None) -> tuple[str, str] | None:
    hit = _matching_spec(name, specs, model_type)
    return (hit[0].partition_type, hit[1]) if hit is not None else None


def check_layer_specs(plan_slices: dict[str, SliceSpec], summed: set[str], pc: PartitionConfig, weights: list[str], model_type: str | None) -> None:
    """What a spec states beyond the role (a fused weight's parts, the split dim, a summed gradient) against the split made."""
    for name in weights:
        hit = _matching_spec(name, pc.layer_specs, model_type)
        if hit is None:
            continue
        spec, pattern = hit
        key = "tensor_parallel.partition_config.layer_specs"
        sliced = plan_slices.get(name)
        if spec.grad_allreduce and name not in summed:
            raise DSCompileConfigError(
                key, f"pattern {pattern!r} asks to sum {name}'s gradient over TP, but from the graph every rank computes all of it", "remove grad_allreduce"
            )
        if sliced is None or spec.partition_type == "skip":
            continue
        if spec.partition_dim is not None and spec.partition_dim != sliced.dim:
            what = f"pattern {pattern!r} splits {name} along dim {spec.partition_dim}, the graph along dim {sliced.dim}"
            raise DSCompileConfigError(key, what, "fix partition_dim")
        if spec.shape is not None:
            parts = spec.shape[sliced.dim]
            found = list(sliced.sections) if sliced.sections else sliced.blocks
            count = len(sliced.sections) or sliced.blocks  # the graph's parts, and whether they are equal
            equal = len(set(sliced.sections)) <= 1
            if isinstance(parts, int):  # a number of equal parts
                agrees = equal and parts == count
            else:  # the parts' sizes (equal blocks have no sizes recorded: only their number and equality can agree)
                agrees = parts == found if sliced.sections else len(set(parts)) == 1 and len(parts) == count
            if not agrees:
                what = f"pattern {pattern!r} gives {name} the parts {parts}, the graph splits it as {found} part(s)"
                raise DSCompileConfigError(key, what, "fix shape, or drop it: the graph finds the parts")


def apply_layer_specs(
    blocks: list[Block], whole: list[dict[str, Any]], pc: PartitionConfig, weights: list[str], model_type: str | None = None
) -> list[Block]:
    """Keep the blocks that ``layer_specs`` allow; an impossible override is an error naming its pattern."""
    roles = {c.weight: "column" for b in blocks for c in b.columns} | {b.row.weight: "row" for b in blocks}
    for name in weights:
        hit = _spec_for(name, pc.layer_specs, model_type)
        if hit is None or hit[0] == "skip":
            continue
        kind, pattern = hit
        if roles.get(name) != kind:
            found = roles.get(name, "not part of any block the graph lets split")
            raise DSCompileConfigError(
                "tensor_parallel.partition_config.layer_specs",
                f"pattern {pattern!r} asks {name} to be {kind}-parallel, but from the graph it is {found}",
                "fix the pattern or its partition_type (skip keeps a block replicated)",
            )
    kept = []
    for b in blocks:
        names = [c.weight for c in b.columns] + [b.row.weight]
        hits = [_spec_for(n, pc.layer_specs, model_type) for n in names]
        if any(h is not None and h[0] == "skip" for h in hits):
            whole.append({"row": b.row.weight, "columns": names[:-1], "reason": "layer_specs: skip"})
        elif not pc.use_default_specs and any(h is None for h in hits):
            whole.append({"row": b.row.weight, "columns": names[:-1], "reason": "use_default_specs is false and layer_specs do not name every linear"})
        else:
            kept.append(b)
    return kept
