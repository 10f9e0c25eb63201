"""Fold ``mm``/``addmm`` + [free view] + [relu/gelu/silu] + [residual add] chains into one call of the Triton
matmul-epilogue template (``kernels/matmul_epilogue.py``), so the epilogue is not left to a separate pointwise
kernel. The fusion pass applies it before forming regions, for the triton lowering on a GPU."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from dscompile.graph import ds_meta
from dscompile.kernels import matmul_epilogue

aten = torch.ops.aten

# aten activation op (and its kwargs) -> the template's activation name
_ACT_OPS = {aten.relu.default: "relu", aten.silu.default: "silu", aten.gelu.default: "gelu"}
_VIEW_OPS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _only_user(node: torch.fx.Node) -> torch.fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _val(arg: Any) -> torch.Tensor | None:
    value = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _activation(node: torch.fx.Node) -> str | None:
    if node.op != "call_function" or node.target not in _ACT_OPS:
        return None
    name = _ACT_OPS[node.target]
    if name == "gelu":
        approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        return "gelu_tanh" if approximate == "tanh" else "gelu" if approximate == "none" else None
    return name


def _match(mm: torch.fx.Node) -> tuple[dict[str, Any], list[torch.fx.Node]] | None:
    """The epilogue chain after one mm/addmm: (template arguments, nodes it replaces), or None."""
    if mm.target == aten.addmm.default:
        if mm.kwargs.get("beta", 1) != 1 or mm.kwargs.get("alpha", 1) != 1 or len(mm.args) != 3:
            return None
        bias, a, b = mm.args
        bias_val = _val(bias)
        if bias_val is None or bias_val.dim() != 1:
            return None
    elif mm.target == aten.mm.default and len(mm.args) == 2:
        bias, (a, b) = None, mm.args
    else:
        return None
    a_val, b_val, out_val = _val(a), _val(b), _val(mm)
    if a_val is None or b_val is None or out_val is None or matmul_epilogue.template_applies(a_val, b_val, _val(bias), None) is not None:
        return None
    if any(not isinstance(s, int) for t in (a_val, b_val) for s in t.shape):
        return None  # dynamic shapes stay aten
    chain, last, activation, residual = [mm], mm, "none", None
    nxt = _only_user(last)
    if nxt is not None and nxt.op == "call_function" and nxt.target in _VIEW_OPS and nxt.args[0] is last:
        chain.append(nxt)
        last = nxt
        nxt = _only_user(last)
    if nxt is not None and _activation(nxt) is not None and nxt.args[0] is last:
        activation = _activation(nxt)
        chain.append(nxt)
        last = nxt
        nxt = _only_user(last)
    if nxt is not None and nxt.op == "call_function" and nxt.target == aten.add.Tensor and nxt.kwargs.get("alpha", 1) == 1 and len(nxt.args) == 2:
        other = nxt.args[1] if nxt.args[0] is last else nxt.args[0] if nxt.args[1] is last else None
        other_val, last_val, add_val = _val(other), _val(last), _val(nxt)
        if (
            other_val is not None
            and last_val is not None
            and add_val is not None
            and tuple(other_val.shape) == tuple(last_val.shape) == tuple(add_val.shape)
            and other_val.dtype == last_val.dtype == add_val.dtype
        ):
            residual = other
            chain.append(nxt)
            last = nxt
    if activation == "none" and residual is None:
        return None  # a bare matmul, or addmm's bias alone, is already one cuBLAS call
    shape = tuple(int(s) for s in _val(last).shape)
    return {"a": a, "b": b, "bias": bias, "residual": residual, "activation": activation, "out_shape": shape}, chain


def fold_matmul_epilogues(gm: torch.fx.GraphModule, enabled: bool | None = None) -> int:
    """Fold ``mm``/``addmm`` [+ view] [+ relu/gelu/silu] [+ residual add] into template calls.

    Only chains with an activation or a residual add are folded (addmm's bias alone is already one
    cuBLAS call). ``enabled=None`` folds on a GPU only (under the CPU interpreter the template is
    for tests). Intermediate results used elsewhere (saved for backward, say) end the chain there,
    so the rewrite never duplicates work. Returns the number of folded chains.
    """
    if enabled is None:
        enabled = matmul_epilogue.template_by_default()  # looked up here, so tests can patch it
    if not enabled:
        return 0
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (aten.mm.default, aten.addmm.default):
            continue
        matched = _match(node)
        if matched is None:
            continue
        args, chain = matched
        last = chain[-1]
        with gm.graph.inserting_after(last):
            new = gm.graph.call_function(
                matmul_epilogue.matmul_epilogue_call, (args["a"], args["b"], args["bias"], args["residual"], args["activation"], args["out_shape"])
            )
        new.meta["val"] = last.meta["val"]
        ds_meta(new)["kernel"] = "matmul_epilogue"
        ds_meta(new)["epilogue"] = [n.name for n in chain]
        last.replace_all_uses_with(new)
        for dead in reversed(chain):
            gm.graph.erase_node(dead)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count
