"""The default lowering and the record of what runs each node.

The default (``lower`` unset or ``auto``) is Inductor on a GPU as on a CPU: dscompile's Triton codegen measured
2.3x slower than Inductor on an H200, and Inductor is plain ``torch.compile``'s code generator, so the default
is no slower than ``torch.compile`` by construction. ``lower: triton`` still selects the codegen. The choice is
written into each node's metadata (``lowered_by``) and, with a dump, into the graph's last step ``<NN>_lower/``
(``nodes.txt`` and ``lowering.txt``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dscompile.backends.assignment import assign_nodes, node_assignment
from dscompile.config import load_config
from dscompile.frontend import AUTO_LOWERING_REASON, resolve_lowering
from dscompile.passes.fusion import triton_lowering_selected
from dscompile.pipeline import pipeline_from_config, pipeline_lowering


@pytest.fixture
def cuda_present(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the selection sees on a GPU machine (no CUDA work is done)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_default_lowering_is_inductor_on_a_gpu(cuda_present: None) -> None:
    assert resolve_lowering(None) == resolve_lowering("auto") == "inductor"
    config = load_config({})  # no "lower" key: the default
    assert not triton_lowering_selected(config)  # no fusion regions: Inductor fuses on its own
    invocations = pipeline_from_config(config)
    assert "fuse" not in [inv.name for inv in invocations]
    assert resolve_lowering(pipeline_lowering(invocations)) == "inductor"


def test_triton_lowering_stays_selectable(cuda_present: None) -> None:
    config = load_config({"lower": "triton"})
    assert resolve_lowering("triton") == "triton"
    assert triton_lowering_selected(config)
    assert "fuse" in [inv.name for inv in pipeline_from_config(config)]


class _Rotary(torch.nn.Module):
    """A linear layer, then dscompile's rotary op (what the rotary pass emits on a GPU): one op of each kind."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return torch.relu(torch.ops.dscompile.rotary_embedding(self.proj(x), cos, sin, None))


def _inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    angles = torch.randn(1, 1, 4, 4, generator=g).repeat(1, 1, 1, 2)
    return torch.randn(1, 2, 4, 8, generator=g), angles.cos(), angles.sin()


def test_assignment_names_dscompile_ops_and_the_lowering() -> None:
    gm = torch.fx.symbolic_trace(_Rotary())
    counts = assign_nodes(gm, "inductor")
    by_node = {n.name: n.meta.get("dscompile", {}).get("lowered_by") for n in gm.graph.nodes}
    assert by_node["rotary_embedding"] == "dscompile op rotary_embedding"
    assert by_node["relu"] == "inductor"
    assert by_node["x"] is None  # placeholders are not run by anything
    assert counts["dscompile op rotary_embedding"] == 1
    relu = next(n for n in gm.graph.nodes if n.name == "relu")
    assert node_assignment(relu, "eager") == node_assignment(relu, "triton") == "aten"


@pytest.mark.slow
@pytest.mark.parametrize("lower", [None, "eager"])
def test_dump_states_the_lowering_and_why(tmp_path: Path, lower: str | None) -> None:
    """Compiled with a dump, each lowered graph ends with a ``lower`` step and its ``lowering.txt``: the default says Inductor and why; the
    dscompile op is listed as running its own kernel; the numbers are eager's."""
    model = _Rotary()
    options = {"dump": str(tmp_path)} | ({"lower": lower} if lower else {})
    compiled = torch.compile(model, backend="dscompile", options=options)
    with torch.no_grad():
        torch.testing.assert_close(compiled(*_inputs()), model(*_inputs()))
    reports = [p.read_text() for p in tmp_path.glob("*/*_lower/lowering.txt")]
    assert reports, sorted(p.name for p in tmp_path.iterdir())
    for text in reports:
        assert text.startswith(f"lowering: {lower or 'inductor'}\n"), text
        assert (AUTO_LOWERING_REASON if lower is None else "lower: eager, as configured") in text
        assert "rotary_embedding: dscompile op rotary_embedding" in text
