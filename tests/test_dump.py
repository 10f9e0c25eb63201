"""The dump: every graph before the first pass and after each, with code, table, DOT, summary, HTML."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dscompile.zoo import build


def _compile_and_train(options):
    case = build("gpt")
    compiled = torch.compile(case.model, backend="dscompile", options=options)
    compiled(*case.batch()).backward()


def test_dump_writes_every_graph_and_pass(tmp_path):
    _compile_and_train({"lower": "eager", "dump": str(tmp_path)})
    graphs = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert graphs == ["graph_0.backward", "graph_0.dynamo", "graph_0.forward", "graph_0.joint"]
    forward_steps = sorted(p.name for p in (tmp_path / "graph_0.forward").iterdir() if p.is_dir())
    assert forward_steps == ["00_captured", "01_cse", "02_noop_views", "03_dce", "04_lower"]  # the graph as the lowering got it
    assert (tmp_path / "graph_0.forward" / "04_lower" / "lowering.txt").read_text().startswith("lowering: eager\n")
    assert '"lowered_by": "aten"' in (tmp_path / "graph_0.forward" / "04_lower" / "nodes.txt").read_text()
    step = tmp_path / "graph_0.forward" / "03_dce"
    for name in ("code.py", "nodes.txt", "graph.dot", "summary.json"):
        assert (step / name).stat().st_size > 0, name
    summary = json.loads((step / "summary.json").read_text())
    case = build("gpt")
    assert summary["parameters"] == len(list(case.model.parameters()))
    assert summary["parameter_bytes"] == sum(p.numel() * 4 for p in case.model.parameters())
    assert summary["flops_estimate"] > 0 and summary["peak_live_bytes"] > 0
    assert summary["nodes_by_op"]["placeholder"] >= summary["parameters"]
    assert summary["pass"]["spec"] == "dce"
    assert "digraph" in (step / "graph.dot").read_text()
    assert "aten.mm" in (step / "nodes.txt").read_text() or "aten.addmm" in (step / "nodes.txt").read_text()


def test_html_page_is_self_contained(tmp_path):
    _compile_and_train({"lower": "eager", "dump": str(tmp_path)})
    page = (tmp_path / "graph_0.html").read_text()
    assert "<script>" in page
    # Nothing is fetched: no external scripts, styles or images (SVG namespaces are not fetches).
    for external in ('<script src', '<link ', 'src="http', "src='http", "@import"):
        assert external not in page
    assert page.count("graph_0.backward · ") >= 1 or "graph_0.backward" in page


def test_environment_variable_enables_dump(tmp_path, monkeypatch):
    monkeypatch.setenv("DSCOMPILE_DUMP", str(tmp_path))
    _compile_and_train({"lower": "eager"})
    assert (tmp_path / "graph_0.dynamo" / "00_captured" / "code.py").is_file()


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed: only DOT is written")
def test_svg_is_rendered_when_graphviz_is_present(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    torch.compile(model, backend="dscompile", options={"lower": "eager", "dump": str(tmp_path)})(torch.randn(3, 4)).sum().backward()
    svg = (tmp_path / "graph_0.forward" / "00_captured" / "graph.svg").read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    assert "<svg" in (tmp_path / "graph_0.html").read_text()
