"""Graph inspection: code, node table, DOT/SVG and a summary for every graph after every pass.

Layout: ``DIR/<graph>.<kind>/<NN>_<pass>/{code.py,nodes.txt,graph.dot,graph.svg,summary.json}``; the last step of a
lowered graph is ``<NN>_lower``: the graph as the lowering gets it, each node's ``lowered_by`` in ``nodes.txt``, and
``lowering.txt`` (the lowering and why).
and one self-contained ``DIR/<graph>.html`` per compile that steps through the passes.
"""

from __future__ import annotations

import html
import json
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx

from dscompile.cost import evaluate, format_size, graph_cost, nbytes
from dscompile.graph import META_NAMESPACE, is_collective, node_value, op_name, tensor_values
from dscompile.planner import PLAN_FILE

_STAGE_COLOURS = ["#cfe2f3", "#d9ead3", "#fff2cc", "#f4cccc", "#d9d2e9", "#fce5cd", "#d0e0e3", "#ead1dc"]


def describe_value(value: Any) -> str:
    """``f32[4, 16]`` style description of a node's value."""
    tensors = tensor_values(value)
    if not tensors:
        return "" if value is None else type(value).__name__
    parts = []
    for t in tensors:
        dtype = str(t.dtype).replace("torch.", "")
        short = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64", "int64": "i64", "int32": "i32", "bool": "bool"}.get(dtype, dtype)
        parts.append(f"{short}{list(t.shape)}")
    return ", ".join(parts)


def graph_summary(gm: torch.fx.GraphModule, param_names: dict[int, str] | None = None) -> dict[str, Any]:
    """Counts by op, collectives, parameters, estimated FLOPs and peak live bytes."""
    cost = graph_cost(gm)
    by_op = Counter(op_name(n) for n in gm.graph.nodes)
    collectives = Counter(op_name(n) for n in gm.graph.nodes if is_collective(n))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    param_names = param_names or {}
    param_bytes = 0
    for index in param_names:
        if index < len(placeholders):
            param_bytes += sum(evaluate(nbytes(t)) for t in tensor_values(node_value(placeholders[index])))
    recompute = Counter(str(n.meta["recompute"]).split(".")[-1] for n in gm.graph.nodes if "recompute" in n.meta)
    return {
        "nodes": len(gm.graph.nodes),
        "nodes_by_op": dict(sorted(by_op.items(), key=lambda kv: (-kv[1], kv[0]))),
        "collectives": dict(collectives),
        "num_collectives": sum(collectives.values()),
        "parameters": len(param_names),
        "parameter_bytes": param_bytes,
        "inputs": len(placeholders),
        "flops": str(cost.flops),
        "flops_estimate": evaluate(cost.flops),
        "bytes_moved": evaluate(cost.bytes_moved),
        "collective_bytes": evaluate(cost.collective_bytes),
        "peak_live_bytes": cost.peak_bytes,
        "peak_at": cost.peak_node,
        "recompute_tags": dict(recompute),
    }


def node_table(gm: torch.fx.GraphModule) -> str:
    """One line per node: name, op, value, FLOPs, bytes written, and dscompile metadata."""
    cost = graph_cost(gm)
    rows = [("name", "op", "value", "flops", "bytes", "dscompile")]
    for node in gm.graph.nodes:
        nc = cost.per_node.get(node.name)
        meta = dict(node.meta.get(META_NAMESPACE, {}))
        if "recompute" in node.meta:
            meta["recompute"] = str(node.meta["recompute"]).split(".")[-1]
        rows.append(
            (
                node.name,
                op_name(node),
                describe_value(node_value(node)),
                format_size(nc.flops) if nc and nc.flops else "",
                format_size(nc.bytes_written, "B") if nc and nc.bytes_written else "",
                json.dumps(meta, default=str) if meta else "",
            )
        )
    widths = [min(48, max(len(r[i]) for r in rows)) for i in range(len(rows[0]) - 1)]
    lines = []
    for row in rows:
        cells = [row[i].ljust(widths[i]) for i in range(len(widths))] + [row[-1]]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines) + "\n"


def to_dot(gm: torch.fx.GraphModule, title: str) -> str:
    """DOT text of the graph; nodes coloured by pipeline stage, collectives highlighted."""
    lines = [f'digraph "{title}" {{', "  rankdir=TB;", '  node [shape=box, style="rounded,filled", fontname="monospace", fontsize=10];']
    for node in gm.graph.nodes:
        meta = node.meta.get(META_NAMESPACE, {})
        colour = "#ffffff"
        if "stage" in meta:
            colour = _STAGE_COLOURS[int(meta["stage"]) % len(_STAGE_COLOURS)]
        elif is_collective(node):
            colour = "#f9cb9c"
        elif node.op in ("placeholder", "output"):
            colour = "#eeeeee"
        elif "region" in meta:
            colour = _STAGE_COLOURS[hash(str(meta["region"])) % len(_STAGE_COLOURS)]
        label = f"{node.name}\\n{op_name(node)}"
        if "param" in meta:
            label += f"\\n{meta['param']}"
        value = describe_value(node_value(node))
        if value:
            label += f"\\n{value}"
        label = label.replace('"', "'")
        lines.append(f'  "{node.name}" [label="{label}", fillcolor="{colour}"];')
        for arg in node.all_input_nodes:
            lines.append(f'  "{arg.name}" -> "{node.name}";')
    lines.append("}")
    return "\n".join(lines) + "\n"


def render_svg(dot_text: str) -> str | None:
    """SVG from Graphviz's ``dot`` when it is installed; None otherwise."""
    exe = shutil.which("dot")
    if exe is None:
        return None
    try:
        result = subprocess.run([exe, "-Tsvg"], input=dot_text, capture_output=True, text=True, timeout=60, check=True)
    except (subprocess.SubprocessError, OSError):
        return None
    return result.stdout


@dataclass
class DumpStep:
    graph: str
    step: int
    pass_name: str
    directory: Path
    summary: dict[str, Any]
    code: str
    svg: str | None
    nodes: str = ""


class Dumper:
    """Writes each graph before the first pass and after every pass, plus one HTML page per compile."""

    def __init__(self, directory: str | Path, *, svg: bool = True, svg_max_nodes: int = 150) -> None:
        self.root = Path(directory)
        self.root.mkdir(parents=True, exist_ok=True)
        self.svg = svg
        self.svg_max_nodes = svg_max_nodes
        self.steps: dict[str, list[DumpStep]] = {}

    def next_graph_name(self) -> str:
        """The first ``graph_N`` not yet used in this dump directory (one per Dynamo graph)."""
        used = {p.name.split(".")[0] for p in self.root.iterdir()} | set(self.steps)
        index = 0
        while f"graph_{index}" in used:
            index += 1
        self.steps.setdefault(f"graph_{index}", [])
        return f"graph_{index}"

    def next_step(self, graph_name: str) -> int:
        """The step number after the last one dumped for ``graph_name`` (the lowering's own step comes last)."""
        return sum(1 for s in self.steps.get(graph_name.split(".")[0], []) if s.graph == graph_name)

    def dump(self, gm: torch.fx.GraphModule, ctx: Any, pass_name: str, *, step: int, record: Any = None) -> Path:
        directory = self.root / ctx.graph_name / f"{step:02d}_{pass_name}"
        directory.mkdir(parents=True, exist_ok=True)
        code = gm.print_readable(print_output=False, include_stride=False, include_device=False)
        (directory / "code.py").write_text(code)
        table = node_table(gm)
        (directory / "nodes.txt").write_text(table)
        dot_text = to_dot(gm, f"{ctx.graph_name} after {pass_name}")
        (directory / "graph.dot").write_text(dot_text)
        # Graphviz's layout time grows fast with size: big graphs get DOT only (render it yourself).
        svg = render_svg(dot_text) if self.svg and len(gm.graph.nodes) <= self.svg_max_nodes else None
        if svg is not None:
            (directory / "graph.svg").write_text(svg)
        summary = graph_summary(gm, ctx.param_names)
        summary["graph"] = ctx.graph_name
        summary["after"] = pass_name
        if record is not None:
            summary["pass"] = {"spec": record.pass_spec, "seconds": record.seconds, "nodes_before": record.nodes_before}
        (directory / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        compile_name = ctx.graph_name.split(".")[0]
        self.steps.setdefault(compile_name, []).append(DumpStep(ctx.graph_name, step, pass_name, directory, summary, code, svg, table))
        self._write_html(compile_name)
        return directory

    def _write_html(self, compile_name: str) -> None:
        (self.root / f"{compile_name}.html").write_text(render_html(compile_name, self.steps[compile_name]))


_SUMMARY_KEYS = ("nodes", "num_collectives", "parameters", "flops_estimate", "peak_live_bytes", "collective_bytes")


def render_html(title: str, steps: list[DumpStep]) -> str:
    """One self-contained page: pick a graph and step through its passes (no external assets)."""
    payload = []
    for s in steps:
        payload.append(
            {
                "graph": s.graph,
                "label": f"{s.graph} · {s.step:02d} {s.pass_name}",
                "summary": {k: s.summary.get(k) for k in _SUMMARY_KEYS} | {"collectives": s.summary.get("collectives")},
                "ops": s.summary.get("nodes_by_op"),
                "code": s.code,
                "nodes": s.nodes,
                "svg": s.svg or "",
            }
        )
    data = json.dumps(payload).replace("</", "<\\/")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>dscompile: {html.escape(title)}</title>
<style>
body{{font-family:sans-serif;margin:1em}} pre{{background:#f6f6f6;padding:.6em;overflow:auto;max-height:40em}}
table{{border-collapse:collapse}} td,th{{border:1px solid #ccc;padding:2px 6px;text-align:left}}
#svg svg{{max-width:100%;height:auto}} button{{margin-right:.4em}}
</style></head><body>
<h1>dscompile pass-by-pass: {html.escape(title)}</h1>
<div><button id="prev">&larr; previous pass</button><button id="next">next pass &rarr;</button>
<select id="step"></select></div>
<h2 id="label"></h2><table id="summary"></table><h3>Ops</h3><table id="ops"></table>
<h3>Code</h3><pre id="code"></pre>
<h3>Nodes (dscompile metadata: parameters, stages, fusion regions and why a node was left out)</h3><pre id="nodes"></pre>
<h3>Graph</h3><div id="svg"></div>
<script>
const steps = {data};
const sel = document.getElementById('step');
steps.forEach((s, i) => {{ const o = document.createElement('option'); o.value = i; o.textContent = s.label; sel.appendChild(o); }});
function cell(v) {{ return typeof v === 'object' ? JSON.stringify(v) : v; }}
function rows(obj) {{ return Object.entries(obj || {{}}).map(([k, v]) => `<tr><th>${{k}}</th><td>${{cell(v)}}</td></tr>`).join(''); }}
function show(i) {{
  const s = steps[i]; sel.value = i;
  document.getElementById('label').textContent = s.label;
  document.getElementById('summary').innerHTML = rows(s.summary);
  document.getElementById('ops').innerHTML = rows(s.ops);
  document.getElementById('code').textContent = s.code;
  document.getElementById('nodes').textContent = s.nodes;
  document.getElementById('svg').innerHTML = s.svg || '<p>(no SVG: no Graphviz, or the graph is too large; see graph.dot)</p>';
}}
sel.onchange = () => show(+sel.value);
document.getElementById('prev').onclick = () => show(Math.max(0, +sel.value - 1));
document.getElementById('next').onclick = () => show(Math.min(steps.length - 1, +sel.value + 1));
show(0);
</script></body></html>
"""


def print_summaries(directory: str | Path) -> str:
    """A text table of every dumped step's summary under ``directory``, in order."""
    root = Path(directory)
    lines = [f"{'graph':28} {'step':24} {'nodes':>6} {'colls':>5} {'MFLOP':>11} {'peak MB':>9} {'pass s':>8}"]
    kind_order = {"dynamo": 0, "joint": 1, "forward": 2, "inference": 2, "backward": 3}

    def order(path: Path) -> tuple:
        graph, _, kind = path.parent.parent.name.partition(".")
        return (graph, kind_order.get(kind, 9), path.parent.name)

    for summary_file in sorted(root.glob("*/*/summary.json"), key=order):
        s = json.loads(summary_file.read_text())
        seconds = s.get("pass", {}).get("seconds")
        lines.append(
            f"{s['graph']:28} {summary_file.parent.name:24} {s['nodes']:>6} {s['num_collectives']:>5} "
            f"{s['flops_estimate'] / 1e6:>11.3f} {s['peak_live_bytes'] / 1e6:>9.3f} {'' if seconds is None else f'{seconds:.4f}':>8}"
        )
    plan = root / PLAN_FILE  # the parallel plan (``dscompile dump`` and engines run with ``dump`` write it)
    if plan.is_file():
        lines += ["== parallel plan ==", *plan.read_text().rstrip("\n").splitlines()]
    predicted = root / "communication_predicted.json"
    if predicted.is_file():
        lines += predicted_communication_lines(predicted)
    for comm_file in sorted(root.glob("communication_rank*.json")):
        lines += communication_lines(comm_file)
    return "\n".join(lines)


def predicted_communication_lines(path: Path) -> list[str]:
    """The bytes a rank would send per step and phase under a 1-bit optimizer (``dscompile dump``, no engine run)."""
    record = json.loads(path.read_text())
    lines = [
        f"== predicted: {record['optimizer']} on {record['world_size']} ranks, ZeRO stage {record['zero_stage']}, bytes sent per step "
        f"(an fp32 all-reduce sends {record['fp32_all_reduce_bytes_per_step']}) =="
    ]
    lines += [f"{phase:16} {sent:>12} bytes sent" for phase, sent in record["bytes_sent_per_step"].items()]
    return lines


def communication_lines(path: Path) -> list[str]:
    """The bytes a rank sent per optimizer step (written by engines whose optimizer counts them, e.g. 1-bit Adam)."""
    record = json.loads(path.read_text())
    rank = path.stem.removeprefix("communication_rank")
    lines = [
        f"== rank {rank}: {record['optimizer']} on {record['world_size']} ranks, bytes sent per step "
        f"(an fp32 all-reduce sends {record['fp32_all_reduce_bytes_per_step']}) =="
    ]
    lines += [f"step {s['step']:>6} {s['phase']:16} {s['bytes_sent']:>12} bytes sent" for s in record["steps"]]
    return lines
