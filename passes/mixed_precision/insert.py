"""``_CastInserter``: one walk of the Dynamo graph giving each op its compute dtype, with fake values re-derived.

A cast is inserted once per (value, dtype); parameters stay fp32 and are cast in the graph, so AOTAutograd derives the
backward casts. Under ZeRO-3 it lowers parameter gathers to the low precision first (README.md says why).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import torch
import torch.fx
from torch.fx.node import map_arg

from dscompile.graph import ds_meta, fake_mode_of, node_value, set_fake_value, tensor_values
from dscompile.passes.mixed_precision.policy import POLICIES, Rule, classify, is_zero_gather
from dscompile.pipeline import PassContext

log = logging.getLogger("dscompile.passes.amp")

aten = torch.ops.aten

def _fetch_attr(gm: torch.fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _signature(value: Any) -> tuple:
    return tuple((t.dtype, tuple(t.shape)) for t in tensor_values(value))


class _CastInserter:
    """Walks the graph once, giving each op its compute dtype and re-deriving fake values."""

    def __init__(
        self, gm: torch.fx.GraphModule, ctx: PassContext, low: torch.dtype, policy_name: str, zero3_gather: str = "low"
    ) -> None:
        self.gm, self.graph, self.ctx, self.low = gm, gm.graph, ctx, low
        self.fake_mode = fake_mode_of(gm)
        self.placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        self.param_of = {self.placeholders[i]: name for i, name in ctx.param_names.items() if i < len(self.placeholders)}
        device = next(
            (v.device for n in self.placeholders for v in tensor_values(node_value(n)) if v.is_floating_point()),
            torch.device("cpu"),
        )
        self.policy = POLICIES[policy_name](device)
        self.env: dict[torch.fx.Node, Any] = {}
        self.casts: dict[tuple[torch.fx.Node, torch.dtype], torch.fx.Node] = {}
        self.rules: Counter[str] = Counter()
        self.requests = 0
        self.low_gathers = self._lower_gathers(zero3_gather)
        self.original = {n: node_value(n) for n in self.graph.nodes}

    # -- helpers ---------------------------------------------------------------------------
    def cast(self, src: torch.fx.Node, dtype: torch.dtype, reason: str) -> torch.fx.Node:
        key = (src, dtype)
        if key in self.casts:
            return self.casts[key]
        anchor = self.placeholders[-1] if src.op in ("placeholder", "get_attr") else src
        with self.graph.inserting_after(anchor):
            node = self.graph.call_function(aten._to_copy.default, (src,), {"dtype": dtype})
        self.env[node] = set_fake_value(node, self.fake_mode)
        meta = ds_meta(node)
        meta.update(dtype=dtype, amp="cast", amp_cast={"reason": reason, "source": src.name})
        if src in self.param_of:
            meta["amp_param_cast"] = self.param_of[src]
        for key_ in ("stack_trace", "nn_module_stack"):
            if key_ in src.meta:
                node.meta[key_] = src.meta[key_]
        self.casts[key] = node
        return node

    def _lower_gathers(self, mode: str) -> list[torch.fx.Node]:
        """ZeRO-3: gather ``cast(shard, low)`` instead of the fp32 shard, so half the bytes travel.

        The fp32 gather is replaced by ``cast(low_gather, fp32)``; a low-precision user's cast of
        that folds back to ``low_gather`` in the clean-up, fp32 users (norms, embeddings) read the
        upcast copy. ``mode="exact"`` only lowers gathers that have low-precision users alone.
        """
        lowered = []
        for gather in [n for n in self.graph.nodes if is_zero_gather(n)]:
            shard = gather.args[0]
            value = node_value(shard)
            if not gather.users or not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
                continue
            if mode == "exact" and not all(classify(user, self.policy) == "low" for user in gather.users):
                continue
            low_shard = self.cast(shard, self.low, "gather")
            with self.graph.inserting_after(gather):
                low_gather = self.graph.call_function(gather.target, (low_shard, *gather.args[1:]), dict(gather.kwargs))
            set_fake_value(low_gather, self.fake_mode)
            ds_meta(low_gather).update(dtype=self.low, amp="low", amp_gather_of=gather.name)
            with self.graph.inserting_after(low_gather):
                upcast = self.graph.call_function(aten._to_copy.default, (low_gather,), {"dtype": torch.float32})
            set_fake_value(upcast, self.fake_mode)
            ds_meta(upcast).update(dtype=torch.float32, amp="cast", amp_cast={"reason": "gather", "source": low_gather.name})
            for key in ("stack_trace", "nn_module_stack"):
                if key in gather.meta:
                    low_gather.meta.setdefault(key, gather.meta[key])
            gather.replace_all_uses_with(upcast)
            self.graph.erase_node(gather)
            lowered.append(low_gather)
        return lowered

    def _float(self, arg: torch.fx.Node) -> torch.Tensor | None:
        value = self.env.get(arg)
        return value if isinstance(value, torch.Tensor) and value.is_floating_point() else None

    def _target(self, rule: Rule, value: torch.Tensor, widest: torch.dtype | None) -> torch.dtype | None:
        if value.dtype == torch.float64 and rule != "promote":
            return None  # autocast never touches fp64
        if rule == "low":
            return self.low
        if rule == "fp32":
            return torch.float32 if value.dtype in (torch.float16, torch.bfloat16) else None
        if rule == "promote":
            return widest
        return None

    def _evaluate(self, node: torch.fx.Node) -> Any:
        args = map_arg(node.args, lambda n: self.env[n])
        kwargs = map_arg(node.kwargs, lambda n: self.env[n])
        with self.fake_mode:
            if node.op == "call_method":
                return getattr(args[0], node.target)(*args[1:], **kwargs)
            return node.target(*args, **kwargs)

    def _set_value(self, node: torch.fx.Node, value: Any) -> None:
        self.env[node] = value
        node.meta["val"] = value
        if "example_value" in node.meta:
            node.meta["example_value"] = value

    def _restore(self, node: torch.fx.Node, reason: str) -> None:
        """Give ``node`` back the input dtypes it was traced with."""

        def back(arg: torch.fx.Node) -> torch.fx.Node:
            old = self.original.get(arg)
            now = self._float(arg)
            if now is not None and isinstance(old, torch.Tensor) and old.dtype != now.dtype:
                return self.cast(arg, old.dtype, reason)
            return arg

        node.args = map_arg(node.args, back)
        node.kwargs = map_arg(node.kwargs, back)

    def _changed(self, node: torch.fx.Node) -> bool:
        return any(_signature(self.env[a]) != _signature(self.original.get(a)) for a in node.all_input_nodes)

    # -- the walk --------------------------------------------------------------------------
    def run(self) -> int:
        """Give every op its dtype; returns the casts inserted (ZeRO-3 gather upcasts included)."""
        for node in list(self.graph.nodes):
            if node.op in ("placeholder", "get_attr"):
                value = node_value(node)
                if value is None and node.op == "get_attr":
                    attr = _fetch_attr(self.gm, str(node.target))
                    # a subgraph (an autograd.Function's forward/backward bodies, e.g. tensor parallelism's
                    # collectives) is no value: the op using it is opaque to the policy
                    value = self.fake_mode.from_tensor(attr) if isinstance(attr, torch.Tensor) else None
                    self.original[node] = value
                self.env[node] = value
                continue
            if node.op == "output":
                self._outputs(node)
                continue
            self._visit(node)
        return len(self.casts) + len(self.low_gathers)

    def _visit(self, node: torch.fx.Node) -> None:
        rule = classify(node, self.policy)
        if rule == "opaque":
            if self._changed(node):
                log.info(
                    "%s: '%s' (%s) is opaque to the cast policy; its inputs keep their traced dtypes",
                    self.ctx.graph_name,
                    node.name,
                    node.target,
                )
                self._restore(node, "restore")
            self.env[node] = self.original[node]
            self.rules[rule] += 1
            return
        floats = [self._float(a) for a in node.all_input_nodes]
        widest = None
        if rule == "promote":
            kinds = [v.dtype for v in floats if v is not None]
            widest = kinds[0] if kinds else None
            for d in kinds[1:]:
                widest = torch.promote_types(widest, d)

        def rewrite(arg: torch.fx.Node) -> torch.fx.Node:
            value = self._float(arg)
            if value is None:
                return arg
            target = self._target(rule, value, widest)
            if target is None or target == value.dtype:
                return arg
            self.requests += 1
            return self.cast(arg, target, rule)

        node.args = map_arg(node.args, rewrite)
        node.kwargs = map_arg(node.kwargs, rewrite)
        self.rules[rule] += 1
        if not self._changed(node):
            self.env[node] = self.original[node]
        else:
            try:
                self._set_value(node, self._evaluate(node))
            except Exception as exc:  # an op that cannot take the new dtypes: give it the old ones
                log.info(
                    "%s: '%s' cannot run on the new input dtypes (%s); casting its inputs back",
                    self.ctx.graph_name,
                    node.name,
                    exc,
                )
                self._restore(node, "restore")
                self._set_value(node, self._evaluate(node))
        value = self.env[node]
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            ds_meta(node).update(dtype=value.dtype, amp=rule)

    def _outputs(self, node: torch.fx.Node) -> None:
        def back(arg: torch.fx.Node) -> torch.fx.Node:
            old, now = self.original.get(arg), self._float(arg)
            if now is not None and isinstance(old, torch.Tensor) and old.dtype != now.dtype:
                with self.graph.inserting_before(node):
                    return self.cast(arg, old.dtype, "output")
            return arg

        node.args = map_arg(node.args, back)
