"""Node-metadata helpers shared by every pass, plus the checks the pipeline runs after each pass.

Passes talk to each other only through ``node.meta["dscompile"][...]`` (see ``ds_meta``) and
PyTorch's own metadata (``meta["val"]``, ``meta["recompute"]``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor

from dscompile.errors import DSCompilePassError

META_NAMESPACE = "dscompile"

# Ops whose results are legitimately not tensors (or None) and so may lack a fake value.
_VALUELESS_TARGETS = {"output"}


def ds_meta(node: torch.fx.Node) -> dict[str, Any]:
    """The dscompile metadata dict of a node, created on first use."""
    return node.meta.setdefault(META_NAMESPACE, {})


def node_value(node: torch.fx.Node) -> Any:
    """The node's fake value: AOTAutograd's ``val`` or Dynamo's ``example_value``."""
    if "val" in node.meta:
        return node.meta["val"]
    return node.meta.get("example_value")


def tensor_values(value: Any) -> list[torch.Tensor]:
    """Every tensor inside a (possibly nested) node value."""
    found: list[torch.Tensor] = []

    def visit(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            for item in v:
                visit(item)
        elif isinstance(v, dict):
            for item in v.values():
                visit(item)

    visit(value)
    return found


def op_name(node: torch.fx.Node) -> str:
    """A short, stable name for a node's operation: ``aten.mm``, ``placeholder``, ``mod.fc``."""
    if node.op == "call_function":
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            return f"{target.namespace}.{target._opname}"
        if isinstance(target, torch._ops.OpOverloadPacket):
            return str(target)
        if hasattr(target, "__module__") and hasattr(target, "__name__"):
            module = target.__module__ or ""
            if module.startswith("torch._ops") or module == "_operator":
                module = module.replace("_operator", "operator")
            return f"{module}.{target.__name__}" if module else target.__name__
        return str(target)
    if node.op in ("call_module", "call_method", "get_attr"):
        return f"{node.op}.{node.target}"
    return node.op


def is_collective(node: torch.fx.Node) -> bool:
    """True for a functional collective (or its wait) inserted as a graph node."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    return node.target.namespace in ("_c10d_functional", "c10d_functional", "_dtensor")


def lint_graph(gm: torch.fx.GraphModule, pass_name: str) -> None:
    """Structural checks after a pass: FX's lint plus a fake value on every computing node."""
    try:
        gm.graph.lint()
    except Exception as exc:  # FX raises RuntimeError subclasses with a good message
        raise DSCompilePassError(f"pass '{pass_name}' left a malformed graph: {exc}") from exc
    if not _graph_has_values(gm):
        return  # graphs captured without fake values (plain symbolic_trace) are not checked
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module", "placeholder"):
            if node.op == "call_function" and not node.users and not isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
                continue  # a call Dynamo kept for its side effect (HF Llama's torch._C._log_api_usage_once): no value to describe
            if node.target is operator.setitem:
                continue  # in-place index assignment (T5's shift_right) returns None: Dynamo records no value
            if "val" not in node.meta and "example_value" not in node.meta:
                raise DSCompilePassError(
                    f"pass '{pass_name}' created node '{node.name}' ({op_name(node)}) without meta['val']; set it from the fake value of the new computation"
                )


def _graph_has_values(gm: torch.fx.GraphModule) -> bool:
    return any("val" in n.meta or "example_value" in n.meta for n in gm.graph.nodes if n.op == "placeholder")


def fake_mode_of(gm: torch.fx.GraphModule) -> Any:
    """The FakeTensorMode the graph's values were traced under, or None."""
    for node in gm.graph.nodes:
        if node.op == "placeholder" and isinstance(node_value(node), FakeTensor):
            return node_value(node).fake_mode
    return None


class _FakeReplay(torch.fx.Interpreter):
    """Re-runs a graph on fake tensors and compares each result with the recorded ``meta['val']``."""

    def __init__(self, gm: torch.fx.GraphModule, fake_mode: Any, pass_name: str) -> None:
        super().__init__(gm)
        self.fake_mode = fake_mode
        self.pass_name = pass_name

    def fetch_attr(self, target: str) -> Any:
        value = super().fetch_attr(target)
        if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
            value = self.fake_mode.from_tensor(value)
        return value

    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        if n.op not in ("placeholder", "output"):
            recorded = node_value(n)
            if recorded is not None:
                _compare_values(n, recorded, result, self.pass_name)
        return result


def _same_dims(a: Iterable[Any], b: Iterable[Any]) -> bool:
    a, b = list(a), list(b)
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, int) and isinstance(y, int):
            if x != y:
                return False
        elif str(x) != str(y):
            return False
    return True


def _compare_values(node: torch.fx.Node, recorded: Any, fresh: Any, pass_name: str) -> None:
    old, new = tensor_values(recorded), tensor_values(fresh)
    if len(old) != len(new):
        raise DSCompilePassError(
            f"after pass '{pass_name}', node '{node.name}' ({op_name(node)}) produces {len(new)} tensors but meta['val'] records {len(old)}"
        )
    for a, b in zip(old, new):
        if a.dtype != b.dtype or not _same_dims(a.shape, b.shape):
            raise DSCompilePassError(
                f"after pass '{pass_name}', node '{node.name}' ({op_name(node)}) computes "
                f"{b.dtype}{list(b.shape)} but meta['val'] says {a.dtype}{list(a.shape)}"
            )


def _into_mode(value: Any, fake_mode: Any) -> Any:
    if isinstance(value, FakeTensor) and value.fake_mode is fake_mode:
        return value
    if isinstance(value, torch.Tensor):
        return fake_mode.from_tensor(value)
    return value


def verify_fake_values(gm: torch.fx.GraphModule, pass_name: str) -> None:
    """Debug-mode check: re-propagate fake values through the graph and fail on a mismatch."""
    fake_mode = fake_mode_of(gm)
    if fake_mode is None:
        return
    inputs = [_into_mode(node_value(n), fake_mode) for n in gm.graph.nodes if n.op == "placeholder"]
    with fake_mode:
        _FakeReplay(gm, fake_mode, pass_name).run(*inputs)


def set_fake_value(node: torch.fx.Node, fake_mode: Any | None = None) -> Any:
    """Compute and store ``meta['val']`` for a new call_function node from its inputs' values."""
    if node.op != "call_function":
        raise ValueError("set_fake_value handles call_function nodes")

    def value_of(arg: Any) -> Any:
        return node_value(arg) if isinstance(arg, torch.fx.Node) else arg

    args = torch.fx.node.map_aggregate(node.args, value_of)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, value_of)
    if fake_mode is None:
        # The inputs' own mode first: under Dynamo the tracing context's mode is a different one.
        fake_mode = next((t.fake_mode for t in tensor_values((args, kwargs)) if isinstance(t, FakeTensor)), None)
    if fake_mode is None:
        value = node.target(*args, **kwargs)
    else:
        with fake_mode:
            value = node.target(*args, **kwargs)
    node.meta["val"] = value
    return value


def fill_capture_values(gm: torch.fx.GraphModule) -> int:
    """Give a capture's value-less calls the value they return; returns how many were filled.

    Dynamo keeps some calls for their side effect without an ``example_value``: Hugging Face's
    ``enable_input_require_grads()`` hooks the embeddings with ``output.requires_grad_(True)``, which a
    ``torch.no_grad()`` forward records as a ``requires_grad_`` call_method with no value and no users.
    An in-place method returns its ``self``, so the value is ``self``'s. Two kinds of call return nothing,
    so their value is ``None``: an op whose schema has no returns (``dscompile.pipeline_split()``, the
    pipeline's stage marker, which Dynamo records without a value) and ``torch.export``'s input-guard call
    (``_guards_fn``, which ``ExportedProgram.module()`` inserts after the placeholders with no value). The
    frontend (and the pipeline engine, for its exported graph) fills them before the first pass, so the
    passes and the lint see a described graph.
    """
    filled = 0
    for node in gm.graph.nodes:
        if "val" in node.meta or node_value(node) is not None:
            continue
        if _returns_nothing(gm, node):
            node.meta["val"] = None
            filled += 1
            continue
        if node.op != "call_method" or not node.args or not isinstance(node.args[0], torch.fx.Node):
            continue
        name = str(node.target)
        if name.endswith("_") and not name.endswith("__"):
            value = node_value(node.args[0])
            if value is not None:
                node.meta["example_value"] = value
                filled += 1
    return filled


def _returns_nothing(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """True for a call whose result is ``None`` by construction: an op whose schema (every overload's) has no
    returns, or a call of a ``torch.export`` guard module (``GuardsFn.forward`` returns nothing)."""
    if node.op == "call_function":
        target = node.target
        if isinstance(target, torch._ops.OpOverloadPacket):
            overloads = [getattr(target, name) for name in target.overloads()]
            return bool(overloads) and all(not o._schema.returns for o in overloads)
        return isinstance(target, torch._ops.OpOverload) and not target._schema.returns
    if node.op == "call_module":
        from torch.export._unlift import GuardsFn

        try:
            return isinstance(gm.get_submodule(str(node.target)), GuardsFn)
        except AttributeError:
            return False
    return False


def _rng_wrappers() -> tuple[Any, Any]:
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

    return run_and_save_rng_state, run_with_rng_state


def fill_rng_wrapper_values(gm: torch.fx.GraphModule) -> int:
    """Give the partitioner's RNG wrappers the ``meta['val']`` it leaves out; returns how many were filled.

    When a random op is recomputed in backward (a checkpointed dropout, Hugging Face's
    ``gradient_checkpointing_enable()``) and its mask is drawn from torch's generator (the ``eager``
    lowering, or Inductor under ``fallback_random``), AOTAutograd's partitioner replaces the forward op
    by ``run_and_save_rng_state(op, *args)`` (returns ``(rng_state, out)``) and the backward one by
    ``run_with_rng_state(rng_state, op, *args)``, with no fake value on either. The frontend calls the
    partitioner, so it fills them here, before any forward/backward pass sees the graphs: the wrapped
    op's value, and the generator state's (on the state's ``getitem`` too).
    """
    save_state, with_state = _rng_wrappers()
    fake_mode = fake_mode_of(gm)
    filled = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or "val" in node.meta or node.target not in (save_state, with_state):
            continue
        op, args = (node.args[0], node.args[1:]) if node.target is save_state else (node.args[1], node.args[2:])
        out = _fake_call(op, args, node.kwargs, fake_mode)
        if node.target is with_state:
            node.meta["val"] = out
        else:
            # The generator's state has a fixed size; the partitioner's getitem describes it with a symbolic one
            # (``from_tensor`` under a shape environment), which a fake re-run (debug mode) does not reproduce.
            state = fake_mode.from_tensor(torch.get_rng_state(), static_shapes=True) if fake_mode is not None else torch.get_rng_state()
            for user in node.users:
                if user.target is operator.getitem and user.args[1] == 0:
                    user.meta["val"] = state
            node.meta["val"] = (state, out)
        filled += 1
    return filled


def _fake_call(op: Any, args: Sequence[Any], kwargs: dict[str, Any], fake_mode: Any) -> Any:
    def value_of(arg: Any) -> Any:
        return node_value(arg) if isinstance(arg, torch.fx.Node) else arg

    args = torch.fx.node.map_aggregate(args, value_of)
    kwargs = torch.fx.node.map_aggregate(kwargs, value_of)
    if fake_mode is None:
        return op(*args, **kwargs)
    with fake_mode:
        return op(*args, **kwargs)


def lift_tensor(gm: torch.fx.GraphModule, name: str, tensor: torch.Tensor, resolve: Callable[[Sequence[Any]], torch.Tensor]) -> torch.fx.Node:
    """A placeholder after the Dynamo inputs reading ``tensor``, which becomes an input of the compiled graph.

    For state a pass adds that the model's forward never reads: a pruning mask, a learned mask
    score (an ``nn.Parameter``: AOTAutograd computes its gradient), a bit width the scheduler
    changes between steps. The frontend feeds it on every call as ``resolve(inputs)``, found from
    that call's own Dynamo inputs (e.g. the state a weight parameter points at), never the tensor
    seen at compile time: Dynamo reuses a graph for every instance of a model class (parameters are
    inputs, not guarded by identity), so each instance must bring its own state. In-place updates
    between calls are seen without recompiling. ``tensor`` is the example value. Call on the Dynamo
    graph (``pre_autograd``); ``runtime_inputs`` lists what was lifted, and once AOTAutograd has
    traced the graph ``unlift_runtime_inputs`` gives Dynamo its own placeholders back.
    """
    for node, value, _ in runtime_inputs(gm):
        if value is tensor:  # lifted once per graph: two inputs aliasing one tensor would need guards
            return node
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    taken = {n.name for n in gm.graph.nodes}
    target = name
    suffix = 0
    while target in taken:
        suffix += 1
        target = f"{name}_{suffix}"
    if placeholders:
        with gm.graph.inserting_after(placeholders[-1]):
            node = gm.graph.placeholder(target)
    else:
        with gm.graph.inserting_before(next(iter(gm.graph.nodes))):
            node = gm.graph.placeholder(target)
    fake_mode = fake_mode_of(gm)
    if fake_mode is not None:
        with fake_mode:
            node.meta["val"] = fake_mode.from_tensor(tensor, static_shapes=True)
    else:
        node.meta["val"] = tensor
    node.meta["example_value"] = node.meta["val"]
    node._dynamo_source = None  # type: ignore[attr-defined]  # AOTAutograd asks; nothing in the user's code holds it
    ds_meta(node)["runtime_input"] = (tensor, resolve)
    return node


def runtime_inputs(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, torch.Tensor, Callable[[Sequence[Any]], torch.Tensor]]]:
    """The placeholders ``lift_tensor`` added, in graph order, with their example value and resolver."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "placeholder" and "runtime_input" in node.meta.get(META_NAMESPACE, {}):
            tensor, resolve = ds_meta(node)["runtime_input"]
            out.append((node, tensor, resolve))
    return out


def unlift_runtime_inputs(gm: torch.fx.GraphModule) -> None:
    """Turn the placeholders ``lift_tensor`` added back into attribute reads of their example values.

    The passes edit Dynamo's own graph, and after the backend returns Dynamo reads that graph's
    placeholders as the inputs it must pass: so once AOTAutograd has traced the graph (the
    compiled code no longer reads ``gm``), the lifted inputs leave the placeholder list.
    """
    for node, tensor, _ in runtime_inputs(gm):
        gm.register_buffer(node.name, tensor, persistent=False)
        with gm.graph.inserting_before(node):
            read = gm.graph.get_attr(node.name)
        read.meta.update({k: v for k, v in node.meta.items() if k != META_NAMESPACE})
        node.replace_all_uses_with(read)
        gm.graph.erase_node(node)
    gm.recompile()
