"""Tensor-parallel inference: the training tensor-parallel pass applied to the inference engine's graphs.

``init_inference(model, tensor_parallel={"tp_size": N})`` under ``torchrun`` (N ranks per model) splits
every transformer block Megatron-style with ``passes/tensor_parallel/``: the graph is captured with
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
- Weight-only quantization (``quant``) comes after the split, because the split needs the float
  linears: the captures run on the float stand-in, the pass finds and splits the blocks, and the
  first split, instead of slicing a quantized layer's float weight, packs this rank's slice
  (``dscompile.runtime.inference.weights.pack_slice``: the full weight's groups, cut) and swaps the
  layer for its packed one; the layers left whole are packed whole. Every split graph then reads
  the packed tensors: each ``linear``/``embedding`` (GPT-2's ``addmm``/``mm``) of a quantized weight
  becomes ``packed_linear``/``packed_embedding`` (``use_packed_weights``), the float weight leaves
  the graph. Another op reading a quantized weight is an error naming ``quant``.
- Kernel injection (``replace_with_kernel_inject``) runs the inference fusion passes on each rank's
  split graph when it is compiled (they match the ATen spellings the captured graphs hold): Q/K/V and
  gate/up read the same ``tp_copy`` output and fuse into one matmul over the rank's slices.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError
from dscompile.passes.tensor_parallel import PartitionConfig, apply_layer_specs, capture, find_blocks, rewrite
from dscompile.runtime.inference.generation import cache_keyword, kv_heads_and_dim
from dscompile.runtime.inference.weights import check_q_groups, packed_embedding, packed_linear, packed_storage, quantize_model_weights
from dscompile.runtime.process_groups import ProcessGroups, build_process_groups
from dscompile.runtime.tensor_parallel import SliceSpec

log = logging.getLogger("dscompile.passes.inference_tensor_parallel")

CompileGraph = Callable[[fx.GraphModule, str], Callable[..., Any]]
aten = torch.ops.aten


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


class _SeenOutput:
    """Where ``LogitsModule`` leaves the type of the output it saw while traced."""

    type: type | None = None


class LogitsModule(nn.Module):
    """The model's plain forward (no cache) returning its logits: the engine's ``engine(input_ids)`` under TP.

    ``seen_output``: the class of the model's own output (a Hugging Face ``ModelOutput``), seen while the graph
    is captured, so that the engine hands back that type around the logits, as the model does at tp_size 1
    (Hugging Face's pipelines read ``outputs["logits"]`` and add keys to it)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.seen_output = _SeenOutput()  # an object of its own: export puts the module's own attributes (lists too) back

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if hasattr(getattr(self.model, "config", None), "use_cache"):  # a Hugging Face model: no growing cache in a plain forward
            kwargs = {"use_cache": False, **kwargs}
        out = self.model(*args, **kwargs)
        if not hasattr(out, "logits"):
            return out
        self.seen_output.type = type(out)
        return out.logits


def stand_in(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters are zero-stride tensors of the full shapes (one element each).

    Capturing it gives the graph of the unsliced model without holding its weights; buffers are copied."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape), requires_grad=False)
    return copy.deepcopy(model, memo)


def policy_from_linear_names(model: nn.Module, names: tuple[str, ...], key: str = "injection_policy_tuple") -> dict[type, tuple[str, ...]]:
    """DeepSpeed's ``injection_policy_tuple`` (the all-reduce linears' names, no layer class: what DeepSpeed's engine
    fills in from each ``injection_policy`` value) as an ``injection_policy``: each name's layer is the module its
    matches sit in (a module whose name ends with it, that suffix cut off), by class. A name no module's name ends
    with is an error naming ``key``, as DeepSpeed's ``Injection policy layer ... not valid``."""
    policy: dict[type, list[str]] = {}
    modules = dict(model.named_modules())
    for name in names:
        layers = [full[: -len(name)].rstrip(".") for full in modules if full.endswith(name) and isinstance(modules[full], nn.Linear)]
        if not layers:
            raise DSCompileConfigError(
                key,
                f"no linear of {type(model).__name__} is named like {name!r}",
                "name the row-parallel linears (those followed by an all-reduce) as their names end, e.g. 'self_attn.o_proj'",
            )
        for layer in layers:
            found = policy.setdefault(type(modules[layer]), [])
            if name not in found:
                found.append(name)
    return {cls: tuple(found) for cls, found in policy.items()}


def policy_linears(model: nn.Module, policy: dict[type, tuple[str, ...]], key: str = "injection_policy") -> dict[str, set[str]]:
    """The linears an ``injection_policy`` names, by the name of each layer it covers (DeepSpeed's test: a linear
    whose name inside the layer contains one of the policy's names). A class the model lacks, or a name that
    matches no linear of its layers, is an error naming ``key`` (``injection_policy``, or ``injection_policy_tuple``)."""
    found: dict[str, set[str]] = {}
    for cls, names in policy.items():
        layers = [(n, m) for n, m in model.named_modules() if isinstance(m, cls)]
        if not layers:
            raise DSCompileConfigError(key, f"{type(model).__name__} has no {cls.__name__} layer", "name the model's own layer classes")
        used: set[str] = set()  # a name need not match in every layer (T5's encoder blocks have no EncDecAttention)
        for layer_name, layer in layers:
            linears = {n for n, m in layer.named_modules() if isinstance(m, nn.Linear) and any(name in n for name in names)}
            used |= {name for name in names if any(name in n for n in linears)}
            found[layer_name] = {f"{layer_name}.{n}.weight" if layer_name else f"{n}.weight" for n in linears}
        missing = [name for name in names if name not in used]
        if missing:
            raise DSCompileConfigError(key, f"no {cls.__name__} has a linear named like {missing}", "name the layers' output linears")
    return found


def check_injection_policy(
    model: nn.Module, policy: dict[type, tuple[str, ...]], rows: set[str], read: set[str] | None = None, key: str = "injection_policy"
) -> None:
    """DeepSpeed's ``injection_policy`` says which linears of a layer end in an all-reduce (the row-parallel ones);
    dscompile finds them in the graph. Accepted when the split agrees inside every layer the policy covers (of
    those whose parameters ``read`` holds, when given: an encoder graph says nothing of the decoder's layers);
    otherwise an error naming ``key``, never a split other than the one asked for."""
    for layer_name, named in policy_linears(model, policy, key).items():
        if read is not None and not any(n.startswith(f"{layer_name}.") for n in read):
            continue
        inside = {r for r in rows if r.startswith(f"{layer_name}.")}
        if inside != named:
            raise DSCompileConfigError(
                key,
                f"at {layer_name!r} it names the all-reduce linears {sorted(named)}, the split found {sorted(inside)}",
                f"drop {key} (dscompile finds the row-parallel linears itself)",
            )


class TensorParallelGraphs:
    """The TP group, the model's slices, and the split graphs captured so far (one per input shape).

    ``tp_size`` divides the world: the engine's plan checked it (``planner.plan_inference``)."""

    def __init__(
        self,
        model: nn.Module,
        tp_size: int,
        compile_graph: CompileGraph,
        quant: tuple[int, int | None, bool, bool] | None = None,
        injection_policy: dict[type, tuple[str, ...]] | None = None,
        injection_policy_key: str = "injection_policy",
    ) -> None:
        self.injection_policy = injection_policy  # DeepSpeed's all-reduce linears per layer class: checked against the split
        self.injection_policy_key = injection_policy_key  # the key errors name (injection_policy or injection_policy_tuple)
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
        self.split_blocks: list[dict[str, Any]] = []  # the row and column weights of each block split so far
        self.seen: set[str] = set()  # the model's parameters the graphs captured so far read
        self.quant = quant  # (bits, q_groups, symmetric, embeddings): the layers are packed at the first split
        if quant is not None:
            check_q_groups(model, quant[1])
        self.quantized_layers: dict[str, int] = {}

    def _rows(self) -> set[str]:
        return {b["row"] for b in self.split_blocks}

    def _slice(self, params: dict[str, SliceSpec], packed: set[str]) -> None:
        """The model's parameters in ``params`` keep this rank's slice (in place; the packed ones are packed already)."""
        for pname, spec in params.items():
            if pname not in packed:
                p = self.model.get_parameter(pname)
                p.data = spec.take(p.data, self.groups.tp_rank, self.tp_size).clone()

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
        targets = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr" and n.users}  # the module holds every parameter, used or not
        read = {t[len(prefix) :] for t in targets if t.startswith(prefix)}
        if self.slices is None:
            with torch.no_grad():
                packed: set[str] = set()
                if self.quant is not None:  # from the full weights, before they are sliced
                    bits, q_groups, symmetric, embeddings = self.quant
                    self.quantized_layers.update(
                        quantize_model_weights(self.model, bits, q_groups, symmetric, params, self.groups.tp_rank, self.tp_size, quantize_embeddings=embeddings)
                    )
                    packed = set(packed_storage(self.model))
                self._slice(params, packed)
            self.slices = params
        else:
            seen = read & self.seen  # parameters an earlier graph read: split as it split them
            if {n: s for n, s in params.items() if n in seen} != {n: s for n, s in self.slices.items() if n in seen}:
                changed = sorted(n for n in seen if params.get(n) != self.slices.get(n))
                raise RuntimeError(f"the {name} graph splits the model differently from the first graph: {changed}")
            fresh = {n: s for n, s in params.items() if n not in seen}  # an encoder-decoder's decoder after its encoder
            if fresh and self.quant is not None:
                raise DSCompileNotSupportedError(
                    "quant", f"weight-only quantization under tensor parallelism of parameters the first graph does not read ({sorted(fresh)[:3]})"
                )
            with torch.no_grad():
                self._slice(fresh, set())
            self.slices = {**self.slices, **fresh}
        self.seen |= read
        rows = self._rows()
        for b in blocks:
            if b.row.weight[len(prefix) :] not in rows:  # a block of another graph's than the first (a decoder's after its encoder's)
                self.split_blocks.append({"row": b.row.weight[len(prefix) :], "columns": [c.weight[len(prefix) :] for c in b.columns]})
        if self.injection_policy:
            check_injection_policy(self.model, self.injection_policy, self._rows(), read, self.injection_policy_key)
        if self.quant is not None:
            use_packed_weights(gm, prefix, self.model)
        for pname, _ in list(gm.named_parameters(remove_duplicate=False)):
            _set(gm, pname, self.model.get_parameter(pname[len(prefix) :]))
        for bname, _ in list(gm.named_buffers(remove_duplicate=False)):
            if bname in state:
                _set(gm, bname, state[bname])
            elif bname.startswith(prefix):
                _set(gm, bname, self.model.get_buffer(bname[len(prefix) :]))
        log.info("%s: split %d blocks across %d ranks", name, len(blocks), self.tp_size)
        return self.compile_graph(gm, name)


def use_packed_weights(gm: fx.GraphModule, prefix: str, model: nn.Module) -> None:
    """Every op of ``gm`` reading a weight ``model`` holds packed reads the packed tensors instead.

    ``model``'s packed layers (``packed_storage``) are bound into ``gm`` as buffers; ``linear(x, W, b)``
    and GPT-2's ``addmm(b, x, W)`` / ``mm(x, W)`` (W stored ``[in, out]``) become ``packed_linear``,
    ``embedding(W, ids)`` becomes ``packed_embedding``; the float weights (zero-stride stand-ins) leave ``gm``."""
    storage = packed_storage(model)
    bound: dict[str, dict[str, Any]] = {}
    graph = gm.graph
    for node in list(graph.nodes):
        name = node.target[len(prefix) :] if node.op == "get_attr" and isinstance(node.target, str) and node.target.startswith(prefix) else None
        if name not in storage:
            continue
        path = storage[name]
        layer = model.get_submodule(path)
        if path not in bound:
            attr = "_packed_" + path.replace(".", "_")
            tensors = {"data": layer.qweight, "scale": layer.scales, "zero": layer.zeros}
            for key, tensor in tensors.items():
                if tensor is not None:
                    gm.register_buffer(f"{attr}_{key}", tensor, persistent=False)
            bound[path] = {"attr": attr, "has_zero": layer.zeros is not None}
        attr, has_zero = bound[path]["attr"], bound[path]["has_zero"]
        rows, columns = layer.weight_shape
        meta = {"bits": layer.bits, "group_size": layer.group_size, "rows": rows, "columns": columns}
        for user in list(node.users):
            with graph.inserting_before(user):
                data, scale = graph.get_attr(f"{attr}_data"), graph.get_attr(f"{attr}_scale")
                zero = graph.get_attr(f"{attr}_zero") if has_zero else None
                if user.target is aten.linear.default and user.args[1] is node:
                    bias = user.args[2] if len(user.args) > 2 else user.kwargs.get("bias")
                    new = graph.call_function(packed_linear, (user.args[0], data, scale, zero, bias), meta)
                elif user.target is aten.addmm.default and user.args[2] is node and not user.kwargs:
                    new = graph.call_function(packed_linear, (user.args[1], data, scale, zero, user.args[0]), meta)
                elif user.target is aten.mm.default and user.args[1] is node:
                    new = graph.call_function(packed_linear, (user.args[0], data, scale, zero, None), meta)
                elif user.target is aten.embedding.default and user.args[0] is node:
                    dtype = getattr(layer, "compute_dtype", None) or node.meta["val"].dtype  # the model's dtype, as the packed embedding returns
                    new = graph.call_function(packed_embedding, (data, scale, zero, user.args[1]), {**meta, "dtype": dtype})
                else:
                    raise DSCompileNotSupportedError(
                        "quant",
                        f"weight-only quantization under tensor parallelism: {user.format_node()} reads the quantized weight {name} "
                        "(only linear, addmm/mm and embedding read packed weights)",
                    )
            new.meta.update({k: v for k, v in user.meta.items() if k in ("val", "stack_trace", "nn_module_stack")})
            user.replace_all_uses_with(new)
            graph.erase_node(user)
        graph.erase_node(node)
    for pname, _ in list(gm.named_parameters(remove_duplicate=False)):  # the float weights of the packed layers (tied names too)
        if pname.startswith(prefix) and pname[len(prefix) :] in storage:
            owner, _, leaf = pname.rpartition(".")
            module = gm.get_submodule(owner) if owner else gm
            module._parameters.pop(leaf, None)
    graph.lint()
    gm.recompile()


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

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        values = [*args, *kwargs.values()]
        if not all(isinstance(v, torch.Tensor) for v in values):
            raise TypeError("under tensor parallelism the engine takes tensor inputs only (positional or by keyword)")
        if "labels" in kwargs:
            raise TypeError("under tensor parallelism the engine returns the logits only: compute the loss from them instead of passing labels")
        self.graphs.broadcast(values)
        key = (tuple((tuple(t.shape), t.dtype) for t in args), tuple((k, tuple(t.shape), t.dtype) for k, t in kwargs.items()))
        entry = self._compiled.get(key)
        if entry is None:
            wrapper = LogitsModule(self.graphs.stand_in)
            entry = (self.graphs.split(wrapper, "model.", tuple(args), {}, "forward", kwargs), wrapper.seen_output.type)
            self._compiled[key] = entry
        fn, output_type = entry
        logits = fn(*args, **kwargs)
        return logits if output_type is None else output_type(logits=logits)


class EncoderModule(nn.Module):
    """An encoder-decoder model's encoder (``get_encoder()``), returning its last hidden state."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


class DecoderModule(nn.Module):
    """An encoder-decoder model's forward over the whole decoder sequence (no cache), from the encoder's output."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, decoder_input_ids: torch.Tensor, encoder_hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        from transformers.modeling_outputs import BaseModelOutput  # the model is a transformers model

        encoded = BaseModelOutput(last_hidden_state=encoder_hidden_states)
        return self.model(decoder_input_ids=decoder_input_ids, encoder_outputs=encoded, attention_mask=attention_mask, use_cache=False).logits


# what Hugging Face's generate passes a step that the split step reads as it is: no cache, the default positions, plain outputs
_STEP_DEFAULTS = {"use_cache": (False, None), "past_key_values": (None,), "output_attentions": (False, None), "output_hidden_states": (False, None)}


class TensorParallelSeq2Seq:
    """Hugging Face's ``generate`` of an encoder-decoder model (T5, BART) under TP: the encoder's and the model's
    ``forward`` it calls, as split graphs.

    The encoder runs once per prompt shape. The decoder steps run without a KV cache, over the decoder tokens so far
    right-padded to ``length`` (set by the engine to the generation's longest decoder sequence): the decoder is causal,
    so the logits of the real tokens are those of the unpadded sequence, and one decoder graph serves every step
    (the captured graphs have static shapes; a growing cache would capture one per token)."""

    def __init__(self, graphs: TensorParallelGraphs) -> None:
        self.graphs = graphs
        self.length = 1
        self._compiled: dict[tuple, Callable[..., Any]] = {}

    def _graph(self, kind: str, args: tuple[torch.Tensor, ...]) -> Callable[..., Any]:
        key = (kind, *((tuple(t.shape), t.dtype) for t in args))
        fn = self._compiled.get(key)
        if fn is None:
            wrapper = EncoderModule(self.graphs.stand_in) if kind == "encoder" else DecoderModule(self.graphs.stand_in)
            fn = self._compiled[key] = self.graphs.split(wrapper, "model.", args, {}, "prefill" if kind == "encoder" else "decode")
        return fn

    def encoder(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
        """The encoder's ``forward`` as ``generate`` calls it: the last hidden state of the split encoder graph."""
        from transformers.modeling_outputs import BaseModelOutput

        _check_step_arguments(kwargs, {"return_dict": (True, None)})
        if input_ids is None:
            raise TypeError("generate of an encoder-decoder model under tensor parallelism takes input_ids (not inputs_embeds)")
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        self.graphs.broadcast([input_ids, mask])
        return BaseModelOutput(last_hidden_state=self._graph("encoder", (input_ids, mask))(input_ids, mask))

    def forward(
        self, decoder_input_ids: torch.Tensor | None = None, encoder_outputs: Any = None, attention_mask: torch.Tensor | None = None, **kwargs: Any
    ) -> Any:
        """The model's ``forward`` as ``generate`` calls it for a step: the logits of the decoder tokens so far."""
        from transformers.modeling_outputs import Seq2SeqLMOutput

        mask = kwargs.pop("decoder_attention_mask", None)
        if mask is not None and not bool(mask.all()):
            raise TypeError("generate of an encoder-decoder model under tensor parallelism takes no decoder_attention_mask with padding")
        kwargs.pop("cache_position", None)  # the default positions: no cache
        kwargs.pop("return_dict", None)
        _check_step_arguments(kwargs, {})
        if decoder_input_ids is None or encoder_outputs is None:
            raise TypeError("under tensor parallelism the engine's encoder-decoder steps take decoder_input_ids and encoder_outputs")
        hidden = encoder_outputs[0]
        mask = torch.ones(hidden.shape[:2], dtype=torch.long, device=hidden.device) if attention_mask is None else attention_mask
        batch, steps = decoder_input_ids.shape
        self.length = max(self.length, steps)
        padded = decoder_input_ids.new_zeros(batch, self.length)  # any token: the causal decoder's real positions never read them
        padded[:, :steps] = decoder_input_ids
        self.graphs.broadcast([padded, hidden, mask])
        logits = self._graph("decoder", (padded, hidden, mask))(padded, hidden, mask)
        return Seq2SeqLMOutput(logits=logits[:, :steps])


def _check_step_arguments(kwargs: dict[str, Any], allowed: dict[str, tuple[Any, ...]]) -> None:
    """Every argument ``generate`` passes a split step is one it reads as the model would: else a clear error."""
    for key, value in kwargs.items():
        accepted = {**_STEP_DEFAULTS, **allowed}.get(key)
        if accepted is None or not any(value is a or (a is not None and value == a) for a in accepted):
            raise TypeError(
                f"generate of an encoder-decoder model under tensor parallelism does not take {key}={value!r} (no cache, no attentions or hidden states)"
            )
