"""``dscompile demo``: trains under the default lowering, reports compile progress, matches eager."""

from __future__ import annotations

import io
import re
import time

import pytest

from dscompile.cli import build_parser
from dscompile.demo import CompileProgress, run_demo


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_rewrites_one_line_and_records_phases() -> None:
    out = _Terminal()
    with CompileProgress(out, interval=0.01) as progress:
        progress.set("Dynamo: capturing the model's graph")
        time.sleep(0.2)
        progress.on_event("graph_0", "lowering the forward graph with inductor")
        time.sleep(0.2)
    text = out.getvalue()
    assert "\r  [" in text and "graph_0: lowering the forward graph with inductor" in text
    assert text.count("\r") >= 4  # redrawn while the phase lasted, not only on changes
    assert [phase for phase, _ in progress.timings] == ["Dynamo: capturing the model's graph", "graph_0: lowering the forward graph with inductor"]
    assert all(seconds >= 0.04 for _, seconds in progress.timings)
    assert progress._thread is not None and not progress._thread.is_alive()


def test_progress_in_a_pipe_prints_one_line_per_phase() -> None:
    out = io.StringIO()
    with CompileProgress(out) as progress:
        progress.set("a")
        progress.set("b")
    assert re.findall(r"\[\s*[\d.]+ s\] (\w)", out.getvalue()) == ["a", "b"]
    assert progress._thread is None


@pytest.mark.slow
def test_demo_under_the_default_lowering_shows_progress_and_matches_eager() -> None:
    out = io.StringIO()
    losses = run_demo(steps=2, out=out)
    text = out.getvalue()
    for phase in ("Dynamo: capturing the model's graph", "passes on the joint graph", "lowering the forward graph with inductor",
                  "lowering the backward graph with inductor", "compiled in"):
        assert phase in text, phase
    assert "lowering: inductor" in text and "graph_0.backward" in text
    # README: "a one-layer GPT-style model (17k parameters) for 5 AdamW steps"
    params = int(re.search(r"1 layer, d_model \d+, ([\d,]+) parameters", text).group(1).replace(",", ""))
    assert round(params / 1000) == 17, params
    assert build_parser().parse_args(["demo"]).steps == 5
    for eager, compiled in zip(losses["eager"], losses["dscompile"]):
        assert abs(eager - compiled) <= 1e-6, (eager, compiled)  # README: "they agree to about 1e-6" (measured 4.8e-7: one ulp)
