"""``TensorParallelModule``: what the engine runs under tensor parallelism.

At the first batch it captures and splits the model (``parallelize``), then runs the compiled split graph; a new
batch shape or train/eval mode is captured again from the gathered weights and must split alike. Every batch is
broadcast within its TP group first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

from dscompile.errors import DSCompileConfigError
from dscompile.passes.tensor_parallel.config import TensorParallelConfig
from dscompile.passes.tensor_parallel.graph_facts import SECTION, attr_value
from dscompile.passes.tensor_parallel.split import TensorParallelPlan, parallelize, without_cache_request
from dscompile.runtime.process_groups import ProcessGroups
from dscompile.runtime.tensor_parallel import broadcast_in_tp_group, gather_slices


class TensorParallelModule(nn.Module):
    """What the engine runs: at the first batch, capture and split the model; then the split graph.

    Every rank of a TP group must see the same batch: the tensors of each batch are broadcast from the
    group's first rank (DeepSpeed leaves this to the data loader, and gets it wrong silently when it is).
    """

    def __init__(
        self, model: nn.Module, groups: ProcessGroups, tc: TensorParallelConfig, compile_options: Callable[[], Any] | None, after_split: Any = None
    ) -> None:
        """``compile_options``: asked for the backend's options at each compile (the engine's config under its plan as
        it is then, a re-plan included); None: the split graph runs uncompiled."""
        super().__init__()
        self.after_split = after_split
        self.model = model
        self.groups = groups
        self.tc = tc
        self.compile_options = compile_options
        self.plan: TensorParallelPlan | None = None
        # the split graph, kept out of the module tree: an exported module refuses train()/eval(), and the mode
        # is checked against the captured one instead
        self.__dict__["_graphs"] = {}  # (training, input signature) -> the compiled split graph
        self._first: tuple[bool, Any] | None = None  # the mode and signature of the first capture
        self._first_wrapped = False  # whether an extension (ZeRO-2/3) wrapped the first split graph
        self.__dict__["_first_run"] = None  # what runs the first split graph (ZeRO-2/3's wrapper, if any): out of the tree too

    @property
    def output_dtype_module(self) -> nn.Module:
        """The model whose 16-bit outputs' dtypes the engine mirrors (probed before the first batch splits it)."""
        return self.model

    def _split(self, args: tuple, kwargs: dict) -> fx.GraphModule:
        """Capture the model at this batch and rewrite its graph (partitioning the parameters in place)."""
        if self.plan is not None:
            return self._split_again(args, kwargs)
        gm, self.plan = parallelize(self.model, args, kwargs, self.groups, self.tc)
        return gm

    def _split_again(self, args: tuple, kwargs: dict) -> fx.GraphModule:
        """Another batch shape or train/eval mode (an evaluation loop): the model is captured from its whole
        weights, gathered over the TP group for the capture only, and must split as the first capture did;
        each rank then keeps the very slices (same tensors) the optimizer steps."""
        assert self.plan is not None
        specs = self.plan.slices
        tensors = {name: attr_value(self.model, name) for name in specs}
        with self._whole_parameters():
            held = {name: t.data for name, t in tensors.items()}
            try:
                with torch.no_grad():
                    for name, t in tensors.items():
                        t.data = specs[name].assemble(gather_slices(held[name], self.groups))
                gm, again = parallelize(self.model, args, kwargs, self.groups, self.tc)
            finally:
                for name, t in tensors.items():
                    t.data = held[name]
        if again.slices != specs:
            changed = sorted(set(again.slices) ^ set(specs)) or sorted(n for n in specs if again.slices[n] != specs[n])
            raise DSCompileConfigError(
                self.config_key,
                f"the graph captured for this batch ({'training' if self.model.training else 'eval'} mode) splits the parameters "
                f"differently from the first one ({', '.join(changed[:4])})",
                "keep the batch shape and mode of the first batch",
            )
        return gm

    config_key = SECTION  # the key errors name

    def split_graphs(self) -> list[fx.GraphModule]:
        """The split graphs captured so far (one per batch shape and mode), before their compilation."""
        out = []
        for graph in self._graphs.values():
            graph = getattr(graph, "_orig_mod", graph)  # torch.compile's wrapper
            if isinstance(graph, fx.GraphModule):
                out.append(graph)
        return out

    def captures_again(self) -> bool:
        """Each new batch shape or train/eval mode is captured and split anew (from the weights gathered for the
        capture), and wrapped as the first graph was (ZeRO-2/3 run it over their shards)."""
        return not self._first_wrapped or hasattr(self._first_run, "wrapping")

    def _whole_parameters(self) -> contextlib.AbstractContextManager[None]:
        """For a later capture: the parameters hold their values (ZeRO-3 keeps only shards between steps)."""
        first = self._first_run
        return first.whole_parameters() if self._first_wrapped and hasattr(first, "whole_parameters") else contextlib.nullcontext()  # type: ignore[union-attr]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        kwargs = without_cache_request(kwargs)
        broadcast_in_tp_group(list(args) + list(kwargs.values()), self.groups)
        signature = [(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v for v in list(args) + list(kwargs.values())]
        key = (self.model.training, repr(signature))
        graph = self._graphs.get(key)
        if graph is None:
            if self._first is not None and not self.captures_again():
                self._refuse_another_capture(signature)
            gm = self._split(args, kwargs)
            run: nn.Module = gm
            if self._first is None:
                run = self.after_split(gm) if self.after_split is not None else gm
                self._first, self._first_wrapped = (self.model.training, signature), run is not gm
                self.__dict__["_first_run"] = run
            elif self._first_wrapped:  # the same ZeRO-2/3 ops, over the same shards, around the new graph
                run = self._first_run.wrapping(gm)  # type: ignore[union-attr, operator]
            graph = torch.compile(run, backend="dscompile", options=self.compile_options()) if self.compile_options is not None else run
            self._graphs[key] = graph
        return graph(*args, **kwargs)

    def _refuse_another_capture(self, signature: Any) -> None:
        assert self._first is not None
        training, first = self._first
        if training != self.model.training:
            raise DSCompileConfigError(
                self.config_key,
                f"the graph was captured and split in {'training' if training else 'eval'} mode (dropout baked in); "
                f"the model is now in {'training' if self.model.training else 'eval'} mode",
                f"keep one mode per engine: switching train/eval after the first batch is not built under {self.config_key} "
                "with what wraps its first graph",
            )
        raise DSCompileConfigError(
            self.config_key,
            f"the graph was captured and split for inputs {first}, and what wraps it cannot wrap another; this batch is {signature}",
            "keep the batch shape fixed (pad the last batch, or drop it: dataloader_drop_last)",
        )
