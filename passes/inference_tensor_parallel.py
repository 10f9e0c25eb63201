"""Tensor-parallel inference: the training tensor-parallel pass applied to the inference engine's graphs.

``init_inference(model, tensor_parallel={"tp_size": N})`` under ``torchrun`` (N ranks per model) splits
every transformer block Megatron-style with ``passes/tensor_parallel.py``: the graph is captured with
``torch.export``, the blocks are found and rewritten there (column/row-parallel linears, the head
count divided in every view, an all-reduce after each row-parallel linear), and the parameters are
sliced in place, once. What inference adds:

- The KV cache is state inside the graph: each step runs ``CacheStateModule`` (the model plus its
  static cache tensors as buffers), so the cache writes (``index_copy_``) are graph nodes the pass
  follows. The pass slices each cache buffer by heads like the keys and values written into it, so a
  rank's cache holds only its heads (``StaticCacheGenerator`` allocates it at ``kv_heads / N``; one head,
  its query heads' own, when there are fewer KV heads than ranks and the pass replicates them).
- The captured graphs have static shapes (the export bakes batch and length into the views), so a
  graph is captured per input shape: one decode graph per batch size (reused for every token), one
  prefill graph per prompt shape. Captures after the first run on a stand-in of the model whose
  parameters are zero-stride tensors of the full shapes (the real ones are sliced by then); the cache
  of that capture is allocated at full size for the capture only.
- Every block must split: a block left whole (heads not divisible by N, an op the pass does not
  know) would keep a full-size cache the sliced one cannot hold, so it is an error naming
  ``tensor_parallel.tp_size``, never a silent replication.
- Inputs are broadcast from the TP group's first rank at every step (as in training), so every rank
  runs the same tokens even if sampling drew differently.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from dscompile.errors import DSCompileConfigError
from dscompile.passes.tensor_parallel import PartitionConfig, apply_layer_specs, capture, find_blocks, rewrite
from dscompile.runtime.inference.generation import cache_keyword, kv_heads_and_dim
from dscompile.runtime.process_groups import ProcessGroups, build_process_groups
from dscompile.runtime.tensor_parallel import SliceSpec

log = logging.getLogger("dscompile.passes.inference_tensor_parallel")

CompileGraph = Callable[[fx.GraphModule, str], Callable[..., Any]]


class CacheStateModule(nn.Module):
    """One generation step of a causal LM whose static KV cache tensors are this module's buffers.

    ``torch.export`` then records the cache writes as in-place ops on buffers (graph state), not as
    side effects on a Python object it cannot see."""

    def __init__(self, model: nn.Module, cache: Any) -> None:
        super().__init__()
        self.model = model
        self.cache = cache
        self.cache_kwarg = cache_keyword(model)
        for i, layer in enumerate(cache.layers):
            self.register_buffer(f"key_cache_{i}", layer.keys, persistent=False)
            self.register_buffer(f"value_cache_{i}", layer.values, persistent=False)
            self.register_buffer(f"cache_length_{i}", layer.cumulative_length, persistent=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.cache.layers):  # the layers read this module's (traced) buffers
            layer.keys = getattr(self, f"key_cache_{i}")
            layer.values = getattr(self, f"value_cache_{i}")
            layer.cumulative_length = getattr(self, f"cache_length_{i}")
        kwargs = {self.cache_kwarg: self.cache}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True, **kwargs).logits


class LogitsModule(nn.Module):
    """The model's plain forward (no cache) returning its logits: the engine's ``engine(input_ids)`` under TP."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if hasattr(getattr(self.model, "config", None), "use_cache"):  # a Hugging Face model: no growing cache in a plain forward
            kwargs = {"use_cache": False, **kwargs}
        out = self.model(*args, **kwargs)
        return out.logits if hasattr(out, "logits") else out


def stand_in(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters are zero-stride tensors of the full shapes (one element each).

    Capturing it gives the graph of the unsliced model without holding its weights; buffers are copied."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape), requires_grad=False)
    return copy.deepcopy(model, memo)


class TensorParallelGraphs:
    """The TP group, the model's slices, and the split graphs captured so far (one per input shape)."""

    def __init__(self, model: nn.Module, tp_size: int, compile_graph: CompileGraph) -> None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world % tp_size:
            raise DSCompileConfigError(
                "tensor_parallel.tp_size",
                f"{tp_size} ranks per model do not divide the world of {world} process(es)",
                f"launch with torchrun --nproc-per-node {tp_size} (or a multiple), or lower tp_size",
            )
        self.groups: ProcessGroups = build_process_groups(tp_size)
        self.tp_size = tp_size
        self.model = model
        self.compile_graph = compile_graph
        if dist.is_initialized() and dist.get_world_size() > 1:
            with torch.no_grad():  # every rank slices the same full weights
                for tensor in [*model.parameters(), *model.buffers()]:
                    dist.broadcast(tensor, src=0)
        self.stand_in = stand_in(model)
        self.slices: dict[str, SliceSpec] | None = None  # the model's parameter slices (fixed by the first capture)
        self.split_blocks: list[dict[str, Any]] = []

    @property
    def group_name(self) -> str:
        return self.groups.tp_group.group_name if self.groups.tp_group is not None else ""

    def broadcast(self, tensors: list[torch.Tensor]) -> None:
        """The TP group's first rank's inputs on every rank of the group."""
        if self.groups.tp_group is not None:
            for t in tensors:
                dist.broadcast(t, src=self.groups.tp_ranks[0], group=self.groups.tp_group)

    def split(
        self, module: nn.Module, prefix: str, args: tuple, state: dict[str, torch.Tensor], name: str, kwargs: dict[str, Any] | None = None
    ) -> Callable[..., Any]:
        """Capture ``module`` (a wrapper of the stand-in under ``prefix``) at ``args``, split it, bind the real tensors.

        ``state``: the buffers the wrapper owns (the rank's sliced cache), by name."""
        gm = capture(module, args, kwargs or {})
        blocks, whole = find_blocks(gm, self.tp_size)
        blocks = apply_layer_specs(blocks, whole, PartitionConfig(), [n for n, _ in module.named_parameters()])
        if whole or not blocks:
            reasons = "; ".join(f"{w['row']}: {w['reason']}" for w in whole) or "no linear adds to a residual stream"
            raise DSCompileConfigError(
                "tensor_parallel.tp_size",
                f"{type(self.model).__name__} cannot be split across {self.tp_size} ranks for inference ({reasons})",
                "tensor-parallel inference splits transformer blocks (linears feeding attention or an MLP whose output is "
                "added to the residual stream); run this model without tensor_parallel",
            )
        slices = rewrite(gm, blocks, self.group_name, self.tp_size, self.groups.tp_rank)
        params = {n[len(prefix) :]: s for n, s in slices.items() if n.startswith(prefix)}
        if self.slices is None:
            with torch.no_grad():
                for pname, spec in params.items():
                    p = self.model.get_parameter(pname)
                    p.data = spec.take(p.data, self.groups.tp_rank, self.tp_size).clone()
            self.slices = params
            self.split_blocks = [{"row": b.row.weight, "columns": [c.weight for c in b.columns]} for b in blocks]
        elif params != self.slices:
            raise RuntimeError(f"the {name} graph splits the model differently from the first graph: {sorted(set(params) ^ set(self.slices))}")
        for pname, _ in list(gm.named_parameters(remove_duplicate=False)):
            _set(gm, pname, self.model.get_parameter(pname[len(prefix) :]))
        for bname, _ in list(gm.named_buffers(remove_duplicate=False)):
            if bname in state:
                _set(gm, bname, state[bname])
            elif bname.startswith(prefix):
                _set(gm, bname, self.model.get_buffer(bname[len(prefix) :]))
        log.info("%s: split %d blocks across %d ranks", name, len(blocks), self.tp_size)
        return self.compile_graph(gm, name)


def _set(gm: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    module = gm.get_submodule(owner) if owner else gm
    if leaf in module._parameters:
        module._parameters[leaf] = tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor, requires_grad=False)
    else:
        module._buffers[leaf] = tensor


class TensorParallelStep:
    """A prefill or decode step under TP, called as ``StaticCacheGenerator`` calls its steps.

    One split graph per (input shapes, cache object): the generator keeps one cache per batch size, so
    the decode graph is captured once per batch size."""

    def __init__(self, graphs: TensorParallelGraphs, name: str, cache_config: Any) -> None:
        self.graphs = graphs
        self.name = name
        self.cache_config = cache_config
        self._compiled: dict[tuple, tuple[Any, Callable[..., Any]]] = {}

    def __call__(self, *, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        cache = kwargs[cache_keyword(self.graphs.model)]
        self.graphs.broadcast([input_ids, attention_mask, position_ids])
        key = (tuple(input_ids.shape), tuple(attention_mask.shape), tuple(position_ids.shape))
        found = self._compiled.get(key)
        if found is None or found[0] is not cache:
            found = (cache, self._split(cache, input_ids, attention_mask, position_ids))
            self._compiled[key] = found
        return found[1](input_ids, attention_mask, position_ids)

    def _split(self, cache: Any, *args: torch.Tensor) -> Callable[..., Any]:
        from transformers import StaticCache  # the model is a transformers model

        first = cache.layers[0]
        full = StaticCache(config=self.cache_config, max_cache_len=first.max_cache_len)
        heads, head_dim = kv_heads_and_dim(self.graphs.model.config)
        full.early_initialization(first.batch_size, heads, head_dim, first.keys.dtype, first.keys.device)
        state: dict[str, torch.Tensor] = {}
        for i, layer in enumerate(cache.layers):
            state |= {f"key_cache_{i}": layer.keys, f"value_cache_{i}": layer.values, f"cache_length_{i}": layer.cumulative_length}
        return self.graphs.split(CacheStateModule(self.graphs.stand_in, full), "model.", args, state, self.name)


class TensorParallelForward:
    """``engine(input_ids, ...)`` under TP: the model's logits from a split graph per input signature."""

    def __init__(self, graphs: TensorParallelGraphs) -> None:
        self.graphs = graphs
        self._compiled: dict[tuple, Callable[..., Any]] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        values = [*args, *kwargs.values()]
        if not all(isinstance(v, torch.Tensor) for v in values):
            raise TypeError("under tensor parallelism the engine takes tensor inputs only (positional or by keyword)")
        self.graphs.broadcast(values)
        key = (tuple((tuple(t.shape), t.dtype) for t in args), tuple((k, tuple(t.shape), t.dtype) for k, t in kwargs.items()))
        fn = self._compiled.get(key)
        if fn is None:
            fn = self.graphs.split(LogitsModule(self.graphs.stand_in), "model.", tuple(args), {}, "forward", kwargs)
            self._compiled[key] = fn
        return fn(*args, **kwargs)
