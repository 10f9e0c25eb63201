"""Tensor parallelism found from the graph: Megatron-style sharding of every transformer block it sees.

The model is captured (``torch.export``, non-strict, at the first batch, and again for each new batch
shape or train/eval mode, from the weights gathered for the capture) into an ATen graph. For
every linear whose result is added to the residual stream (through dropouts and views), the pass walks
up its input to the linears that feed it without another linear between (``q/k/v``, ``gate/up``,
GPT-2's fused ``c_attn``) and checks that the block between them can run on a slice of the heads /
hidden units: every op in between must keep the sliced dimension whole (views, transposes, pointwise
ops, softmax over another dimension, batched matmuls, SDPA, rotary halves, GQA's repeat). Then:

- the feeding linears become column-parallel (output features split; a fused projection that the
  graph splits into equal parts has each part split, so each rank holds its q, k and v heads),
- the residual-adding linear becomes row-parallel (input features split, bias added once after),
- the view/reshape/expand shapes that carry the head count or hidden size are divided by TP,
- a block whose units (heads; KV-head groups under GQA, each with its query heads; hidden units) TP
  does not divide is padded: every rank runs the largest share, its own units then zero-weight ones,
  and a 0/1 mask on the row-parallel linear's input keeps the padding out of the output and out of
  the gradients (so its weights stay zero); the slices record it (``SliceSpec.units``) and drop it
  when assembled,
- an attention with fewer KV heads ``K`` than ranks ``T`` (MQA, small GQA) where ``T % K == 0`` and ``T``
  divides the query heads ``H`` keeps the KV heads replicated, as Megatron does: rank ``r`` runs its ``H/T``
  query heads and one copy of their KV head ``r*K/T`` (the KV side, the sliced values upstream of the op
  that repeats KV heads for query heads, is sized one head; the repeats become ``H/T``), the k/v weights
  are read through ``tp_sum_replicas`` (the ``T/K`` ranks sharing a head sum its gradient) and their
  slices record the sharing (``SliceSpec.replicas``: one copy assembled, counted once in norms),
- a fused projection that the graph slices into parts of unequal sizes (Phi-3's ``qkv_proj`` under GQA) has
  each part split (``SliceSpec.sections``), and its slices moved to this rank's parts,
- a whole value with a gradient that the split ops read (Qwen3's per-head ``q_norm``/``k_norm`` weights, after
  reductions over the head's own features) is read through ``tp_copy``: each rank's gradient is its heads' part,
- ``tp_copy`` (identity forward, all-reduce of the gradient backward) goes before the block and
  ``tp_reduce`` (all-reduce forward) after the row-parallel linear: functional-collective nodes once
  the graph is compiled,
- the parameters are partitioned in place: the same ``nn.Parameter`` objects (the optimizer's) now
  hold only this rank's slice.

With ``vocab_parallel_lm_head`` the LM head (a linear whose logits a mean cross-entropy reads) is
split by vocabulary rows, the loss becomes a parallel cross-entropy (three all-reduces of per-token
vectors, no gathered logits) and an embedding tied to it a vocabulary-parallel lookup; a vocabulary TP
does not divide is padded with rows the loss leaves out of its softmax. Any other reader of the logits
(a model that returns them, as Hugging Face's do) reads them gathered (``gather_vocabulary``).

With ``sequence_parallel`` (Megatron's sequence parallelism) the split graph is rewritten once more
(``passes/tensor_parallel_sequence.py``): the residual stream between blocks holds each rank's chunk of the sequence (read from the
token ids' shape; a length TP does not divide is padded between the blocks), each block's all-reduce becomes a
reduce-scatter along the sequence and its ``tp_copy`` an all-gather (backward: reduce-scatter), the norms and
residual adds run on the chunk with the gradients of what they broadcast (norm weights, row-parallel biases)
summed over the group, and every other reader reads the gathered sequence.

A block the pass cannot split (an op it does not know, a value used outside the block) stays replicated,
and the reason is logged and kept in the plan (``engine.extension("tensor_parallel").plan``); if no
block can be split, the engine refuses to start. ``partition_config.layer_specs`` (DeepSpeed's regexes
over parameter names, ``partition_type`` ``column`` / ``row`` / ``skip``) overrides the choice: ``skip``
keeps a block replicated, ``column``/``row`` must agree with what the graph allows (else an error names
the pattern), and with ``use_default_specs: false`` only blocks whose every linear is named are split.

The engine's part (``TensorParallelExtension``): TP × DP groups (``runtime/process_groups.py``), every
batch broadcast within its TP group, gradients averaged over the DP group only
(``TensorParallelGradients``), and ZeRO 1-3 over the DP group: the ZeRO extension hands its partitioning
to ``engine.after_parameters_split``, run once the first batch split the model, so it shards the TP
slices (ZeRO-2/3 then run the split graph over their shards, and each later capture's graph over the
same shards; the optimizer ``initialize`` returned is moved onto the shards in place). Checkpoints and
their loads across layouts are ``runtime/tensor_parallel_checkpoint.py``'s. Mixed precision (bf16, fp16 with loss scaling) and activation
checkpointing are the usual passes on the split graph. The pass runs on the exported graph *before* the dscompile pipeline (it changes parameter
shapes, which Dynamo would otherwise guard on); the split graph then compiles through the usual
pipeline and lowering.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import operator
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from dscompile.config import parse_dataclass, register_section, unbuilt
from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError
from dscompile.passes.tensor_parallel.graph_facts import POINTWISE, REDUCTIONS, SECTION, VIEWS, node_shape, view_groups
from dscompile.runtime.engine_core import EngineCore, EngineExtension, register_engine_extension
from dscompile.runtime.process_groups import ProcessGroups, process_groups_for
from dscompile.runtime.tensor_parallel import (
    SliceSpec,
    broadcast_in_tp_group,
    gather_slices,
    gather_vocabulary,
    padded_units,
    tp_copy,
    tp_reduce,
    tp_sum_replicas,
    units_of_rank,
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
)
from dscompile.runtime.tensor_parallel_checkpoint import restore_optimizer
from dscompile.runtime.tensor_parallel_gradients import TensorParallelGradients, TensorParallelOver

log = logging.getLogger("dscompile.passes.tensor_parallel")
aten = torch.ops.aten



# ---------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------
@dataclass
class LayerSpec:
    """DeepSpeed's ``TPLayerSpec``. The graph decides the split; a spec overrides which blocks split (``skip``,
    ``use_default_specs``), and what it states (role, ``shape`` of a fused weight's parts, ``partition_dim``,
    ``grad_allreduce``) is checked against what the graph shows: a disagreement is an error naming the pattern."""

    patterns: list[str] = field(default_factory=list)
    partition_type: str = "column"
    shape: list[Any] | None = None  # a fused weight's parts along partition_dim: [3, -1] equal parts, [[q, k, v], -1] unequal
    partition_dim: int | None = None  # default: 0 for column, 1 for row (an nn.Linear weight)
    model_types: list[str] | None = None  # the spec applies only to models whose config.model_type is listed
    gather_output: bool = unbuilt(False, "a column-parallel linear with gathered output (split an LM head with vocab_parallel_lm_head)")
    grad_allreduce: bool = False  # skip specs: a replicated weight whose gradient each rank computes a part of (summed over TP)

    def validate(self, path: str) -> None:
        if self.partition_type not in ("column", "row", "skip"):
            raise DSCompileConfigError(f"{path}.partition_type", f"{self.partition_type!r} is not a partition type", "use column, row or skip")
        if self.grad_allreduce and self.partition_type != "skip":
            raise DSCompileConfigError(f"{path}.grad_allreduce", "applies to skip specs only (a split weight's gradient is already its own)", "remove it")
        if self.shape is not None:
            if len(self.shape) != 2:
                raise DSCompileNotSupportedError(f"{path}.shape", f"views of a weight as {len(self.shape)}-D sub-parameters (shape {self.shape})")
            dim = self.partition_dim if self.partition_dim is not None else (0 if self.partition_type == "column" else 1)
            parts = self.shape[dim] if 0 <= dim < 2 else None
            whole = self.shape[1 - dim] if 0 <= dim < 2 else None
            if whole != -1 or not (
                (isinstance(parts, int) and parts > 0) or (isinstance(parts, list) and parts and all(isinstance(x, int) and x > 0 for x in parts))
            ):
                fix = "give the parts at partition_dim (a count, or a list of sizes) and -1 at the other dim"
                raise DSCompileConfigError(f"{path}.shape", f"{self.shape} with partition_dim {dim}", fix)
        for pattern in self.patterns:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise DSCompileConfigError(f"{path}.patterns", f"{pattern!r} is not a regular expression ({exc})") from None


@dataclass
class PartitionConfig:
    use_default_specs: bool = True
    layer_specs: list[LayerSpec] = field(default_factory=list)


@dataclass
class TensorParallelConfig:
    autotp_size: int = 1
    tp_overlap_comm: bool = False
    vocab_parallel_lm_head: bool = False  # split the LM head (and an embedding tied to it) by vocabulary rows
    sequence_parallel: bool = False  # Megatron's: the residual stream between blocks sharded along the sequence
    partition_config: PartitionConfig = field(default_factory=PartitionConfig)

    @property
    def enabled(self) -> bool:
        return self.autotp_size > 1


_REFUSED_WHEN_SET = {
    "injection_policy_tuple": "DeepSpeed's injection policies (the pass finds the blocks from the graph)",
    "preset_model": "DeepSpeed's per-architecture presets (the pass finds the blocks from the graph)",
    "keep_module_on_host": "keeping the partitioned module on the host",
    "kernel_inject": "DeepSpeed's inference kernels",
    "replace_with_kernel_inject": "DeepSpeed's inference kernels",
}


def parse_tensor_parallel(value: Any, path: str) -> TensorParallelConfig:
    if not isinstance(value, Mapping):
        raise DSCompileConfigError(path, f"expected a JSON object, got {type(value).__name__}")
    section = dict(value)
    if section.pop("vocab_parallel_ce_backend", "torch") not in ("torch", None):  # DeepSpeed's default is this pass's own (torch ops)
        raise DSCompileNotSupportedError(f"{path}.vocab_parallel_ce_backend", "a vocabulary-parallel cross-entropy other than torch's (liger)")
    for key, capability in _REFUSED_WHEN_SET.items():
        if section.pop(key, None) not in (None, False, "", [], {}):
            raise DSCompileNotSupportedError(f"{path}.{key}", capability)
    dtype = section.pop("dtype", None)
    if dtype is not None:
        raise DSCompileConfigError(f"{path}.dtype", "the parameters' dtype is set by bf16/fp16 here", f"remove {path}.dtype; use the bf16 or fp16 section")
    tp = section.pop("tp", None) or {}
    if not isinstance(tp, Mapping):
        raise DSCompileConfigError(f"{path}.tp", f"expected a JSON object, got {type(tp).__name__}")
    for key in tp:
        if key not in ("tp_size", "tp_grain_size", "mpu", "tp_group"):
            raise DSCompileConfigError(f"{path}.tp.{key}", "unknown key", "valid keys here: tp_size, tp_grain_size, mpu, tp_group")
    if tp.get("mpu") is not None or tp.get("tp_group") is not None:
        raise DSCompileNotSupportedError(f"{path}.tp.mpu", "user-made tensor-parallel groups (dscompile lays out TP × DP itself)")
    if (tp.get("tp_grain_size") or 1) != 1:
        raise DSCompileNotSupportedError(f"{path}.tp.tp_grain_size", "tensor-parallel grains other than 1")
    if section.get("autotp_size") in (None, 0):
        section["autotp_size"] = 1
    tp_size = tp.get("tp_size") or 1
    if tp_size > 1 and section["autotp_size"] not in (1, tp_size):
        raise DSCompileConfigError(f"{path}.tp.tp_size", f"{tp_size} contradicts autotp_size {section['autotp_size']}", "set one of them")
    if tp_size > 1:
        section["autotp_size"] = tp_size
    config = parse_dataclass(TensorParallelConfig, section, path)
    if config.autotp_size < 1:
        raise DSCompileConfigError(f"{path}.autotp_size", f"expected a positive integer, got {config.autotp_size}")
    if config.sequence_parallel and not config.enabled:
        raise DSCompileConfigError(
            f"{path}.sequence_parallel",
            "Megatron's sequence parallelism shards over the tensor-parallel group, and autotp_size is 1",
            "set autotp_size > 1, or drop sequence_parallel",
        )
    return config


register_section(SECTION, parse_tensor_parallel, "tensor parallelism")


def split_graph_sections(sections: Mapping[str, Any]) -> dict[str, Any]:
    """The config sections the split graph compiles under: tensor parallelism is already applied, so its section
    goes, except that with ``tp_overlap_comm`` it stays at ``autotp_size`` 1 (nothing more to split) for the
    ``tp_overlap`` pass (``passes/tensor_parallel_overlap.py``) to read."""
    out = {k: v for k, v in sections.items() if k != SECTION}
    tc = sections.get(SECTION)
    if tc is not None and tc.tp_overlap_comm:
        out[SECTION] = dataclasses.replace(tc, autotp_size=1)
    return out


def tensor_parallel_config(config: Any) -> TensorParallelConfig | None:
    section = config.sections.get(SECTION) if hasattr(config, "sections") else None
    return section if section is not None and section.enabled else None


# ---------------------------------------------------------------------------------------------
# finding the blocks
# ---------------------------------------------------------------------------------------------
class _Unsplittable(Exception):
    """This block cannot run on a slice (the message says why)."""


@dataclass
class Linear:
    """A linear layer in the ATen graph: ``linear(x, W[out, in], b)`` or GPT-2's ``addmm(b, x, W[in, out])``."""

    node: fx.Node
    weight: str
    bias: str | None
    transposed: bool  # W stored [in, out] (Conv1D)

    @property
    def input(self) -> fx.Node:
        return self.node.args[1] if self.transposed else self.node.args[0]  # type: ignore[return-value]


@dataclass
class Block:
    columns: list[Linear]
    row: Linear
    region: list[fx.Node]
    sharded: dict[fx.Node, int]  # node -> its sliced dim
    blocks: dict[fx.Node, int]  # column node -> number of fused parts
    rewrites: dict[fx.Node, tuple[int, int]]  # shape-carrying node -> (arg position in its shape list, its full size)
    units: int  # the block's sliced sizes are multiples of this many units (heads or KV-head groups, hidden units)
    states: dict[str, int] = field(default_factory=dict)  # buffer written in place by the block (a KV cache) -> its sliced dim
    replicas: int = 1  # > 1: fewer KV heads than TP ranks, each held by this many ranks (``_replicated_kv``)
    kv: set[fx.Node] = field(default_factory=set)  # then: the block's KV-side nodes (one head per rank)
    repeats: dict[fx.Node, tuple[int, int]] = field(default_factory=dict)  # then: where KV heads are repeated, and how often
    replicated_states: set[str] = field(default_factory=set)  # then: the buffers written from the KV side (a KV cache)
    sections: dict[fx.Node, dict[fx.Node, tuple[int, int]]] = field(default_factory=dict)  # column -> its feature slices -> [start, end)
    summed: set[str] = field(default_factory=set)  # once rewritten: whole parameters it reads whose gradient is summed over TP


@dataclass
class TensorParallelPlan:
    """What the pass decided: parameter slices, the blocks split and those left whole (with why)."""

    tp_size: int
    slices: dict[str, SliceSpec] = field(default_factory=dict)
    split: list[dict[str, Any]] = field(default_factory=list)
    replicated: list[dict[str, Any]] = field(default_factory=list)
    vocab: list[dict[str, Any]] = field(default_factory=list)  # LM heads split by vocabulary (vocab_parallel_lm_head)
    vocab_replicated: list[dict[str, Any]] = field(default_factory=list)
    sequence_parallel: dict[str, Any] | None = None  # sequence_parallel: the layout and the collectives it put in


def _param_name(node: Any) -> str | None:
    return node.target if isinstance(node, fx.Node) and node.op == "get_attr" else None


def _as_linear(node: fx.Node) -> Linear | None:
    if node.op != "call_function":
        return None
    if node.target is aten.linear.default:
        weight = _param_name(node.args[1])
        bias = _param_name(node.args[2]) if len(node.args) > 2 and node.args[2] is not None else None
        if weight is not None and (len(node.args) <= 2 or node.args[2] is None or bias is not None):
            return Linear(node, weight, bias, transposed=False)
    if node.target is aten.addmm.default and not node.kwargs:
        weight, bias = _param_name(node.args[2]), _param_name(node.args[0])
        if weight is not None and bias is not None:
            return Linear(node, weight, bias, transposed=True)
    return None


_PASSTHROUGH = {aten.dropout.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default}


def _adds_to_residual(node: fx.Node) -> bool:
    """The value reaches an ``add`` through single-use dropouts/views (the residual connection)."""
    for _ in range(6):
        if len(node.users) != 1:
            return False
        (user,) = node.users
        if user.target in (aten.add.Tensor, operator.add):
            return True
        if user.target not in _PASSTHROUGH:
            return _adds_to_residual_after_norm(node)
        node = user
    return False


# what a norm applied to a block's output before the residual add is made of (Gemma2/3's and OLMo2's post-norms)
_NORM_OPS = _PASSTHROUGH | {
    aten._to_copy.default, aten.to.dtype, aten.pow.Tensor_Scalar, aten.mean.dim, aten.var_mean.correction, operator.getitem, aten.add.Tensor, aten.add.Scalar,
    aten.sub.Tensor, aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.rsqrt.default, aten.sqrt.default, aten.type_as.default,
}  # fmt: skip


def _adds_to_residual_after_norm(node: fx.Node, limit: int = 24) -> bool:
    """The value is normalised (its every use one of a norm's ops) and then added to the residual stream: an ``add``
    of the normalised value and a same-shaped tensor that does not come from it. A row-parallel linear's output is
    all-reduced right after the linear, so the norm sees the whole value."""
    shape = node_shape(node)
    derived = {node}
    frontier = [node]
    residual = None
    while frontier:
        for user in frontier.pop().users:
            if user in derived or user is residual:
                continue
            others = [a for a in user.all_input_nodes if a not in derived]
            same_shape = node_shape(user) == shape and len(others) == 1 and node_shape(others[0]) == shape
            if user.target is aten.add.Tensor and same_shape and node not in _ancestors(others[0]):
                if residual is not None:
                    return False
                residual = user
                continue
            if user.target not in _NORM_OPS or len(derived) >= limit:
                return False
            derived.add(user)
            frontier.append(user)
    return residual is not None


def _is_empty(node: Any) -> bool:
    """A 1-D tensor of no elements: ``cat`` skips it (Hugging Face's cache starts as ``torch.tensor([])``)."""
    return node_shape(node) == (0,)


def _view_dim(src: tuple[int, ...], dst: tuple[int, ...], dim: int, heads_of_one: bool = False) -> tuple[int, bool]:
    """The dim of ``dst`` that a view of ``src`` sliced on ``dim`` is sliced on (the outermost of its group), and
    whether a size-one dim before it could have been the sliced one instead.

    Shapes cannot tell ``[.., F] -> [.., 1, F]`` as one head of ``F`` features (MQA's keys) from a size-one
    dim put before ``F`` (a decode step's sequence); the features are the default, ``heads_of_one`` picks the
    size-one dim. A sliced dim of size one (that one head) stays a size-one dim, or the outermost of a merge."""
    for gi, gj in view_groups(src, dst):
        if dim in gi:
            real_src = [d for d in gi if d < len(src) and (src[d] != 1 or d == dim)]
            if real_src[0] != dim:
                raise _Unsplittable(f"a view merges the sliced dimension {dim} of {src} under an outer one")
            real_dst = [d for d in gj if d < len(dst) and dst[d] != 1]
            ones = [d for d in gj if d < len(dst) and dst[d] == 1 and (not real_dst or d < real_dst[0])]
            if ones and (src[dim] == 1 or heads_of_one or not real_dst):
                return ones[-1], False
            return real_dst[0], bool(ones)
    raise _Unsplittable(f"cannot follow dimension {dim} through a view {src} -> {dst}")


class _Propagator:
    """Follows the sliced dimension from the column outputs through a block, noting the shape rewrites.

    It also notes where KV heads become query heads (GQA/MQA's ``repeat_interleave``, Hugging Face's
    ``repeat_kv`` expand + reshape, SDPA's ``enable_gqa``): the sliced values upstream of those are the
    block's KV side, which ``_replicated_kv`` may hold one head of per rank."""

    def __init__(self, tp: int, heads_of_one: bool = False) -> None:
        self.tp = tp
        self.heads_of_one = heads_of_one  # read ``[.., F] -> [.., 1, F]`` views as one head (see ``_view_dim``)
        self.ambiguous = False  # a view could have been read that way
        self.sharded: dict[fx.Node, int] = {}
        self.blocks: dict[fx.Node, int] = {}
        self.rewrites: dict[fx.Node, tuple[int, int]] = {}
        self.origin: dict[fx.Node, fx.Node] = {}  # sliced node -> the column it comes from (while its last dim is the column's)
        self.states: dict[str, int] = {}  # buffers written in place with sliced values (inference's KV cache) -> sliced dim
        self.writers: dict[str, fx.Node] = {}  # such a buffer -> the node writing it
        self.conversions: dict[fx.Node, list[fx.Node]] = {}  # op turning KV heads into query heads -> its KV-side inputs
        self.repeats: dict[fx.Node, tuple[int, int]] = {}  # node -> (its repeat count's place: -1 the argument, else a size's; the count)
        self.sections: dict[fx.Node, dict[fx.Node, tuple[int, int]]] = {}  # column -> its slices along the features -> [start, end)

    def seed(self, column: fx.Node) -> None:
        shape = node_shape(column)
        if shape is None:
            raise _Unsplittable(f"{column.name} has no shape")
        self.sharded[column] = len(shape) - 1
        self.blocks[column] = 1
        self.origin[column] = column

    def visit(self, node: fx.Node) -> None:
        ins = [a for a in node.all_input_nodes if a in self.sharded]
        if not ins:
            return
        target = node.target
        src = ins[0]
        d = self.sharded[src]
        in_shape, out_shape = node_shape(src), node_shape(node)
        if target in VIEWS:
            assert in_shape is not None and out_shape is not None
            out, ambiguous = _view_dim(in_shape, out_shape, d, self.heads_of_one)
            self.ambiguous |= ambiguous
            if out == len(out_shape) - 1 and in_shape[d] == out_shape[-1] and d == len(in_shape) - 1 and src in self.origin:
                self.origin[node] = self.origin[src]  # the column's features stay the last dim (Conv1D's 2-D -> 3-D view)
            else:
                self._check_whole(src)
            self._note_repeat_kv(node, src, d, out, in_shape, out_shape)
            self._note_shape(node, out, out_shape)
            self.sharded[node] = out
        elif target is aten.transpose.int:
            a, b = (x % len(in_shape) for x in node.args[1:3])  # type: ignore[operator]
            self.sharded[node] = b if d == a else a if d == b else d
            self._inherit(node, src)
        elif target is aten.permute.default:
            self.sharded[node] = list(x % len(in_shape) for x in node.args[1]).index(d)  # type: ignore[union-attr]
            self._inherit(node, src)
        elif target is aten.unsqueeze.default:
            k = node.args[1] % len(out_shape)  # type: ignore[operator]
            self.sharded[node] = d + 1 if k <= d else d
        elif target is aten.repeat_interleave.self_int:  # GQA: each rank's KV heads repeated for its query heads
            dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
            if dim is None:
                raise _Unsplittable("repeat_interleave over the flattened tensor")
            size = node.kwargs.get("output_size")
            if dim % len(in_shape) == d:  # type: ignore[operator]
                if size is not None:
                    self.rewrites[node] = (-3, int(size))
                if isinstance(node.args[1], int):
                    self.conversions[node] = [src]
                    self.repeats[node] = (-1, node.args[1])
            self.sharded[node] = d
        elif target is aten.expand.default:
            out = d + len(out_shape) - len(in_shape)
            self._note_shape(node, out, out_shape)
            self.sharded[node] = out
        elif target in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
            dim = node.args[2] % len(in_shape) if len(node.args) > 2 else 0  # type: ignore[operator]
            parts = [node_shape(u) for u in node.users]
            if dim == d:
                if src not in self.origin or self.blocks[self.origin[src]] != 1 or len({p for p in parts}) != 1:
                    raise _Unsplittable("the sliced dimension is split unevenly or twice")
                self.blocks[self.origin[src]] = sum(1 for _ in node.users) if target is not aten.split_with_sizes.default else len(node.args[1])  # type: ignore[arg-type]
                self._split_arg(node, in_shape[d])
            self.sharded[node] = d
        elif target is operator.getitem:
            self.sharded[node] = d
        elif target is aten.index_copy_.default:  # a KV-cache write: the cache buffer holds this rank's heads only
            cache, dim, source = node.args[0], node.args[1] % len(out_shape), node.args[3]  # type: ignore[operator]
            if source is not src or not isinstance(cache, fx.Node) or cache.op != "get_attr" or dim == d:
                raise _Unsplittable(f"{node.name} writes sliced values into something other than a buffer's unsliced dimension")
            self.states[str(cache.target)] = d
            self.writers[str(cache.target)] = node
            self.sharded[node] = d
        elif target is aten.cat.default:
            parts = [a for a in node.args[0] if not _is_empty(a)]  # type: ignore[union-attr]  # an empty cache: cat skips it
            if any(a not in self.sharded for a in parts):
                raise _Unsplittable("cat of a sliced and a whole tensor")
            if len({self.sharded[a] for a in parts}) != 1:
                raise _Unsplittable(f"{node.name} joins tensors sliced along different dimensions")
            dim = (node.args[1] if len(node.args) > 1 else 0) % len(out_shape)  # type: ignore[operator]
            if dim == self.sharded[parts[0]]:
                raise _Unsplittable(f"{target} along the sliced dimension")
            self.sharded[node] = self.sharded[parts[0]]
        elif target is aten.slice.Tensor and (node.args[1] if len(node.args) > 1 else 0) % len(in_shape) == d:  # type: ignore[operator]
            self._note_section(node, src, d, in_shape)
            self.sharded[node] = d
        elif target in (aten.slice.Tensor, aten._softmax.default, aten.softmax.int, aten._log_softmax.default):
            dim = node.args[1] if len(node.args) > 1 else 0
            dim = dim % len(out_shape)  # type: ignore[operator]
            if dim == d:
                raise _Unsplittable(f"{target} along the sliced dimension")
            self.sharded[node] = d
        elif target is aten.select.int:  # Bloom's q/k/v picked from each head's fused [3, head_dim]
            dim = node.args[1] % len(in_shape)  # type: ignore[operator]
            if dim == d:
                raise _Unsplittable(f"{target} along the sliced dimension")
            self.sharded[node] = d if dim > d else d - 1
        elif target is aten.stack.default:  # GPT-J's interleaved rotary: stack([-x2, x1], dim=-1)
            parts = node.args[0]
            if any(a not in self.sharded for a in parts) or len({self.sharded[a] for a in parts}) != 1:  # type: ignore[union-attr]
                raise _Unsplittable("stack of tensors not all sliced alike")
            dim = (node.args[1] if len(node.args) > 1 else 0) % len(out_shape)  # type: ignore[operator]
            self.sharded[node] = d + 1 if dim <= d else d
        elif target is aten.flatten.using_ints:  # the rotary pairs merged back (GPT-J, Cohere)
            start = (node.args[1] if len(node.args) > 1 else 0) % len(in_shape)  # type: ignore[operator]
            end = (node.args[2] if len(node.args) > 2 else -1) % len(in_shape)  # type: ignore[operator]
            if start < d <= end:
                raise _Unsplittable("a flatten merges the sliced dimension under an outer one")
            self.sharded[node] = d if d <= start else d - (end - start)
        elif target in REDUCTIONS:
            dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
            if not dims:
                raise _Unsplittable(f"{node.name} ({target}) reduces every dimension")
            dims = [x % len(in_shape) for x in ([dims] if isinstance(dims, int) else dims)]  # type: ignore[union-attr]
            if d in dims:
                raise _Unsplittable(f"{target} along the sliced dimension")
            keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
            self.sharded[node] = d if keepdim else d - sum(1 for x in dims if x < d)
        elif target in POINTWISE:
            outs = set()
            for a in node.all_input_nodes:
                sa = node_shape(a)
                if a in self.sharded:
                    outs.add(self.sharded[a] + len(out_shape) - len(sa))  # type: ignore[arg-type]
            if len(outs) != 1:
                raise _Unsplittable(f"{node.name} mixes tensors sliced along different dimensions")
            (out,) = outs
            for a in node.all_input_nodes:
                sa = node_shape(a)
                if a not in self.sharded and sa is not None:
                    k = out - (len(out_shape) - len(sa))
                    if k >= 0 and sa[k] != 1:
                        raise _Unsplittable(f"{node.name} combines a sliced tensor with a whole one ({a.name}) along the sliced dimension")
            self.sharded[node] = out
        elif target in (aten.matmul.default, aten.bmm.default):
            a, b = node.args[0], node.args[1]
            sa, sb = node_shape(a), node_shape(b)
            out = None
            for x, sx in ((a, sa), (b, sb)):
                if x in self.sharded:
                    k = self.sharded[x]
                    if k >= len(sx) - 2:  # type: ignore[arg-type]
                        raise _Unsplittable(f"{node.name} contracts or produces along the sliced dimension")
                    o = k + len(out_shape) - len(sx)  # type: ignore[arg-type]
                    if out is not None and o != out:
                        raise _Unsplittable(f"{node.name} mixes sliced dimensions")
                    out = o
            for x, sx in ((a, sa), (b, sb)):
                if x not in self.sharded and sx is not None:
                    k = out - (len(out_shape) - len(sx))  # type: ignore[operator]
                    if k >= 0 and sx[k] != 1:
                        raise _Unsplittable(f"{node.name} multiplies by a whole tensor along the sliced dimension")
            self.sharded[node] = out  # type: ignore[assignment]
        elif target is aten.scaled_dot_product_attention.default:
            q, k, v = node.args[:3]
            if any(self.sharded.get(x) != 1 for x in (q, k, v)):  # type: ignore[call-overload]
                raise _Unsplittable("attention whose query, key and value are not all sliced by heads")
            if node.kwargs.get("enable_gqa"):  # query heads attend to their KV head inside the op
                self.conversions[node] = [k, v]  # type: ignore[list-item]
            mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
            sm = node_shape(mask)
            if sm is not None and len(sm) == 4 and sm[1] != 1:
                raise _Unsplittable("an attention mask per head")
            self.sharded[node] = 1
        else:
            raise _Unsplittable(f"{node.name} ({target}) is not known to keep a slice of heads/hidden units whole")

    def _inherit(self, node: fx.Node, src: fx.Node) -> None:
        pass

    def _note_section(self, node: fx.Node, src: fx.Node, d: int, in_shape: tuple[int, ...]) -> None:
        """A fused projection cut into parts by slices of its features (Phi-3's ``qkv[..., :q]``, ``qkv[..., q:q+kv]``, ...):
        each part is split on its own, so the parts may differ in size (GQA's q against k and v)."""
        column = self.origin.get(src)
        if column is None or self.blocks[column] != 1:
            raise _Unsplittable("a slice along the sliced dimension of something other than a projection's features")
        if any(u.target is not aten.slice.Tensor or (u.args[1] if len(u.args) > 1 else 0) % len(in_shape) != d for u in src.users):  # type: ignore[operator]
            raise _Unsplittable(f"{src.name} is read both whole and by slices of its features")
        step = node.args[4] if len(node.args) > 4 else 1
        if step != 1:
            raise _Unsplittable("a strided slice along the sliced dimension")
        size = in_shape[d]
        start, end = (node.args[2] if len(node.args) > 2 else 0), (node.args[3] if len(node.args) > 3 else size)
        if not isinstance(start, int) or not isinstance(end, int):
            raise _Unsplittable(f"{node.name} slices the features at symbolic bounds")
        start, end = (min(max(b + size if b < 0 else b, 0), size) for b in (start, end))
        self.sections.setdefault(column, {})[node] = (start, end)

    def _note_repeat_kv(self, node: fx.Node, src: fx.Node, d: int, out: int, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> None:
        """Hugging Face's ``repeat_kv``: ``expand`` a size-one dim after the KV heads to ``n_rep``, then a view merging
        both into the query heads."""
        if src.target is not aten.expand.default or d + 1 >= len(in_shape) or in_shape[d + 1] == 1:
            return
        before = node_shape(src.args[0])
        if before is None or len(before) != len(in_shape) or before[d + 1] != 1 or out_shape[out] != in_shape[d] * in_shape[d + 1]:
            return
        self.conversions[node] = [src]
        self.repeats[src] = (d + 1, in_shape[d + 1])

    def _check_whole(self, src: fx.Node) -> None:
        if src in self.origin and self.blocks[self.origin[src]] != 1:
            raise _Unsplittable("a fused projection is viewed before it is split into its parts")

    def _note_shape(self, node: fx.Node, out: int, out_shape: tuple[int, ...]) -> None:
        sizes = node.args[1]
        if isinstance(sizes, (list, tuple)) and out < len(sizes):
            entry = sizes[out]
            if isinstance(entry, int) and entry != -1:
                self.rewrites[node] = (out, out_shape[out])
            elif not isinstance(entry, int):
                raise _Unsplittable(f"{node.name} has a symbolic size on the sliced dimension")

    def _split_arg(self, node: fx.Node, size: int) -> None:
        if node.target is aten.split.Tensor:
            self.rewrites[node] = (-1, int(node.args[1]))  # type: ignore[arg-type]
        elif node.target is aten.split_with_sizes.default:
            self.rewrites[node] = (-2, 0)


def _region(row: Linear, linears: dict[fx.Node, Linear]) -> tuple[list[Linear], set[fx.Node]]:
    """Walk up from the row linear's input to the linears feeding it; the nodes in between."""
    columns: dict[fx.Node, Linear] = {}
    seen: set[fx.Node] = set()
    stack = [row.input]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in linears:
            columns[node] = linears[node]
            continue
        if node.op != "call_function":
            continue
        stack.extend(node.all_input_nodes)
    return list(columns.values()), seen


def _units(prop: _Propagator, nodes: Any = None) -> int:
    """The most units every sliced size of the block (or of ``nodes`` in it) is a whole multiple of (their gcd):
    heads, or KV-head groups under GQA (a query head is sliced with its KV head), or hidden units; the split is in these."""
    sizes = []
    for node, dim in prop.sharded.items():
        shape = node_shape(node)
        if shape is not None and (nodes is None or node in nodes):
            sizes.append(shape[dim] // prop.blocks.get(node, 1))  # a fused projection: each of its parts
    sizes += [size for node, (pos, size) in prop.rewrites.items() if pos == -1 and (nodes is None or node in nodes)]  # split(x, size): each part
    units = math.gcd(*sizes)
    if units < 1:
        raise _Unsplittable("a sliced dimension has size 0")
    return units


def _kv_side(prop: _Propagator) -> set[fx.Node]:
    """The sliced nodes upstream of the ops that turn KV heads into query heads (the k/v projections to those ops)."""
    kv: set[fx.Node] = set()
    stack = [x for inputs in prop.conversions.values() for x in inputs if x in prop.sharded]
    while stack:
        node = stack.pop()
        if node not in kv:
            kv.add(node)
            stack.extend(a for a in node.all_input_nodes if a in prop.sharded)
    return kv


def _replicated_kv(prop: _Propagator, units: int, tp: int) -> tuple[int, set[fx.Node], str]:
    """Megatron's answer to fewer KV heads ``K`` than ranks ``T``: when ``T % K == 0`` and ``T`` divides the query
    heads ``H``, rank ``r`` holds query heads ``[r H/T, (r+1) H/T)`` and one copy of their KV head ``r K / T``
    (``T/K`` ranks per KV head). ``(T/K, KV-side nodes, "")``, or ``(1, {}, why not)``: then the block is padded."""
    if units % tp == 0 or not prop.conversions:
        return 1, set(), ""
    kv = _kv_side(prop)
    for node in kv:
        for user in node.users:
            if user in prop.sharded and user not in kv and node not in prop.conversions.get(user, ()):
                return 1, set(), f"{node.name} feeds both the KV heads and the query heads"
    query = set(prop.sharded) - kv
    kv_units, query_units = _units(prop, kv), _units(prop, query)
    if tp % kv_units or query_units % tp or query_units % kv_units:
        return 1, set(), f"{kv_units} KV heads do not divide TP={tp}, or TP does not divide {query_units} query heads"
    return tp // kv_units, kv, ""


def _analyse(prop: _Propagator, columns: list[Linear], row: Linear, region: list[fx.Node]) -> _Propagator:
    """Follow the sliced dimension through the block and check the row linear reads it as its features."""
    for c in columns:
        prop.seed(c.node)
    for n in region:
        prop.visit(n)
    for column, cuts in prop.sections.items():
        bounds = sorted(set(cuts.values()))
        size = node_shape(column)[-1]  # type: ignore[index]
        if bounds[0][0] != 0 or bounds[-1][1] != size or any(a[1] != b[0] for a, b in zip(bounds, bounds[1:])):
            raise _Unsplittable(f"the slices of {column.name}'s features {bounds} do not cut it into parts")
    if row.input not in prop.sharded:
        raise _Unsplittable("its input does not come from the feeding linears")
    last = node_shape(row.input)
    if prop.sharded[row.input] != len(last) - 1:  # type: ignore[arg-type]
        raise _Unsplittable("its input is sliced along another dimension than its features")
    return prop


def find_blocks(gm: fx.GraphModule, tp: int) -> tuple[list[Block], list[dict[str, Any]]]:
    """Every residual block the graph allows splitting, and the residual linears it does not (with why)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    linears = {n: lin for n in gm.graph.nodes if (lin := _as_linear(n)) is not None}
    blocks: list[Block] = []
    whole: list[dict[str, Any]] = []
    for row in linears.values():
        if not _adds_to_residual(row.node):
            continue
        columns, walked = _region(row, linears)
        try:
            if not columns:
                raise _Unsplittable("no linear feeds it")
            inputs = {c.input for c in columns}
            if len(inputs) != 1:
                raise _Unsplittable("the linears feeding it read different inputs")
            region = sorted((n for n in walked if n not in linears and n.op == "call_function"), key=order.__getitem__)
            prop = _Propagator(tp)
            try:
                _analyse(prop, columns, row, region)
            except _Unsplittable as first:
                if not prop.ambiguous:
                    raise
                try:  # a view may have split the features as one head (one KV head: MQA): read it that way
                    prop = _analyse(_Propagator(tp, heads_of_one=True), columns, row, region)
                except _Unsplittable as again:
                    raise _Unsplittable(f"{first}; reading size-one view dims as one head: {again}") from None
            sliced_region = [n for n in region if n in prop.sharded]
            inside = set(sliced_region) | {c.node for c in columns}
            for n in inside:
                outside = [u.name for u in n.users if u not in inside and u is not row.node]
                if outside:
                    raise _Unsplittable(f"{n.name} is also used outside the block ({', '.join(outside)})")
            units = _units(prop)
            replicas, kv, why = _replicated_kv(prop, units, tp)
            if prop.sections and (replicas > 1 or units % tp):
                raise _Unsplittable(f"a projection fused of parts of unequal sizes whose {units} units TP={tp} does not divide")
            if replicas > 1:
                log.info("tensor_parallel: %s: %d KV heads on TP=%d, each held by %d ranks with their query heads", row.weight, tp // replicas, tp, replicas)
            elif units % tp:
                padded = padded_units(units, tp) * tp
                log.info("tensor_parallel: %s splits %d units (heads or hidden units) over TP=%d, padded with zeros to %d", row.weight, units, tp, padded)
                if why:
                    log.info("tensor_parallel: %s: KV heads not replicated: %s", row.weight, why)
            block = Block(columns, row, sliced_region, prop.sharded, prop.blocks, prop.rewrites, units, prop.states, sections=prop.sections)
            if replicas > 1:
                block.replicas, block.kv, block.repeats = replicas, kv, prop.repeats
                block.replicated_states = {name for name, writer in prop.writers.items() if writer in kv}
            blocks.append(block)
        except _Unsplittable as exc:
            whole.append({"row": row.weight, "columns": [c.weight for c in columns], "reason": str(exc)})
            log.warning("tensor_parallel: %s stays replicated: %s", row.weight, exc)
    return blocks, whole


# ---------------------------------------------------------------------------------------------
# the vocabulary-parallel LM head (``vocab_parallel_lm_head``)
# ---------------------------------------------------------------------------------------------
@dataclass
class VocabHead:
    """``cross_entropy_loss(view(linear(h, W)), targets)``, and the embeddings that read ``W`` (tied weights)."""

    linear: Linear
    views: list[fx.Node]
    loss: fx.Node
    embeddings: list[fx.Node]
    vocab: int
    ignore_index: int
    chain: list[fx.Node]  # the linear, then the views and casts to the loss (any other user of them reads gathered logits)


def _arg(node: fx.Node, position: int, name: str, default: Any) -> Any:
    return node.args[position] if len(node.args) > position else node.kwargs.get(name, default)


def _attr(gm: nn.Module, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _casts_only(node: fx.Node) -> bool:
    """A dtype conversion and nothing else (the parallel cross-entropy computes in fp32 whatever the logits' dtype)."""
    if node.target is aten.to.dtype:
        return True
    return node.target is aten._to_copy.default and set(node.kwargs) <= {"dtype"}


_PER_LOGIT = {aten.div.Tensor, aten.mul.Tensor, aten.div.Scalar, aten.mul.Scalar, aten.tanh.default, aten.add.Scalar, aten.sub.Scalar}


def _per_logit(node: fx.Node) -> bool:
    """An op on each logit alone with constants (Gemma2's ``tanh(logits / cap) * cap``): it runs on a vocabulary slice as is."""
    return node.target in _PER_LOGIT and not any(isinstance(a, fx.Node) for a in [*node.args[1:], *node.kwargs.values()])


def find_vocab_heads(gm: fx.GraphModule) -> tuple[list[VocabHead], list[dict[str, Any]]]:
    """Every mean cross-entropy computed straight from a linear's logits (the LM head), and those left whole (why)."""
    heads: list[VocabHead] = []
    whole: list[dict[str, Any]] = []
    for loss in gm.graph.nodes:
        if loss.target is not aten.cross_entropy_loss.default:
            continue
        try:
            if _arg(loss, 2, "weight", None) is not None or _arg(loss, 3, "reduction", 1) != 1 or _arg(loss, 5, "label_smoothing", 0.0):
                raise _Unsplittable("only the mean cross-entropy without class weights or label smoothing is split by vocabulary")
            logits = loss.args[0]
            if len(node_shape(logits) or ()) != 2:
                raise _Unsplittable("the loss does not read [tokens, vocabulary] logits")
            views, x, chain = [], logits, []
            while x.target in VIEWS or _casts_only(x) or _per_logit(x):  # views, Hugging Face's logits.float(), Gemma2's soft-capping
                if x.target in VIEWS:
                    views.append(x)
                chain.insert(0, x)
                x = x.args[0]
            chain.insert(0, x)
            head = _as_linear(x)
            if head is None or head.transposed or head.bias is not None:
                raise _Unsplittable("the loss does not read the logits of a linear without bias")
            if any(h.linear.node is x for h in heads):
                raise _Unsplittable(f"the LM head {x.name} also feeds another loss")
            vocab = node_shape(x)[-1]  # type: ignore[index]
            if any((node_shape(v) or (0,))[-1] != vocab for v in views):
                raise _Unsplittable("a view between the LM head and the loss moves the vocabulary dimension")
            param = _attr(gm, str(x.args[1].target))  # type: ignore[union-attr]
            readers = [n for n in gm.graph.nodes if n.op == "get_attr" and _attr(gm, str(n.target)) is param]  # tied: any name
            embeddings = [u for r in readers for u in r.users if u is not x]
            for u in embeddings:
                if u.target is not aten.embedding.default or len(u.args) > 3 or u.kwargs:  # a padding_idx (Gemma's) is kept
                    raise _Unsplittable(f"the LM head's weight is also read by {u.name} ({u.target}), not a plain embedding")
            heads.append(VocabHead(head, views, loss, embeddings, vocab, int(_arg(loss, 4, "ignore_index", -100)), chain))
        except _Unsplittable as exc:
            whole.append({"loss": loss.name, "reason": str(exc)})
            log.warning("tensor_parallel: the LM head of %s stays replicated: %s", loss.name, exc)
    return heads, whole


def rewrite_vocab_heads(gm: fx.GraphModule, heads: list[VocabHead], group: Any, tp: int, rank: int, names: dict[str, str]) -> dict[str, SliceSpec]:
    """Split each head's weight by vocabulary rows: its logits stay local, the loss becomes the parallel
    cross-entropy, a tied embedding a vocabulary-parallel lookup. A vocabulary TP does not divide is padded
    with zero rows that the loss leaves out of its softmax."""
    graph = gm.graph
    slices: dict[str, SliceSpec] = {}
    held = [padded_units(h.vocab, tp) for h in heads]
    for head, local in zip(heads, held):
        first, count = units_of_rank(head.vocab, rank, tp)
        x = head.linear.input
        with graph.inserting_before(head.linear.node):
            copied = graph.call_function(tp_copy, (x, group))
        copied.meta["val"] = x.meta.get("val")
        head.linear.node.replace_input_with(x, copied)
        for node, onward in zip(head.chain, [*head.chain[1:], head.loss]):
            others = [u for u in node.users if u is not onward]
            if others:  # the logits are also returned (Hugging Face's output) or read elsewhere: those read them whole
                with graph.inserting_after(node):
                    whole = graph.call_function(gather_vocabulary, (node, group, tp, rank, head.vocab))
                whole.meta["val"] = node.meta.get("val")
                for user in others:
                    user.replace_input_with(node, whole)
        for view in head.views:
            sizes = list(view.args[1])  # type: ignore[arg-type]
            if sizes[-1] != -1:
                sizes[-1] = local
                view.args = (view.args[0], sizes, *view.args[2:])
        with graph.inserting_after(head.loss):
            parallel = graph.call_function(vocab_parallel_cross_entropy, (head.loss.args[0], head.loss.args[1], group, first, count, head.ignore_index))
        parallel.meta["val"] = head.loss.meta.get("val")
        head.loss.replace_all_uses_with(parallel)
        graph.erase_node(head.loss)
        for embedding in head.embeddings:
            with graph.inserting_after(embedding):
                padding = embedding.args[2] if len(embedding.args) > 2 else -1
                lookup = graph.call_function(vocab_parallel_embedding, (embedding.args[0], embedding.args[1], group, first, count, padding))
            lookup.meta["val"] = embedding.meta.get("val")
            embedding.replace_all_uses_with(lookup)
            graph.erase_node(embedding)
        weight = str(head.linear.node.args[1].target)  # type: ignore[union-attr]
        slices[names.get(weight, weight)] = SliceSpec(dim=0, units=head.vocab if head.vocab % tp else 0)
    graph.lint()
    gm.recompile()
    return slices


# ---------------------------------------------------------------------------------------------
# layer_specs
# ---------------------------------------------------------------------------------------------
def _matching_spec(name: str, specs: list[LayerSpec], model_type: str | None = None) -> tuple[LayerSpec, str] | None:
    """The first spec (for this model type) with a pattern that matches ``name``, and that pattern."""
    for spec in specs:
        if spec.model_types is not None and model_type not in spec.model_types:
            continue
        for pattern in spec.patterns:
            if re.search(pattern, name):
                return spec, pattern
    return None


def _spec_for(name: str, specs: list[LayerSpec], model_type: str | None = None) -> tuple[str, str] | None:
    hit = _matching_spec(name, specs, model_type)
    return (hit[0].partition_type, hit[1]) if hit is not None else None


def check_layer_specs(plan_slices: dict[str, SliceSpec], summed: set[str], pc: PartitionConfig, weights: list[str], model_type: str | None) -> None:
    """What a spec states beyond the role (a fused weight's parts, the split dim, a summed gradient) against the split made."""
    for name in weights:
        hit = _matching_spec(name, pc.layer_specs, model_type)
        if hit is None:
            continue
        spec, pattern = hit
        key = "tensor_parallel.partition_config.layer_specs"
        sliced = plan_slices.get(name)
        if spec.grad_allreduce and name not in summed:
            raise DSCompileConfigError(
                key, f"pattern {pattern!r} asks to sum {name}'s gradient over TP, but from the graph every rank computes all of it", "remove grad_allreduce"
            )
        if sliced is None or spec.partition_type == "skip":
            continue
        if spec.partition_dim is not None and spec.partition_dim != sliced.dim:
            what = f"pattern {pattern!r} splits {name} along dim {spec.partition_dim}, the graph along dim {sliced.dim}"
            raise DSCompileConfigError(key, what, "fix partition_dim")
        if spec.shape is not None:
            parts = spec.shape[sliced.dim]
            found = list(sliced.sections) if sliced.sections else sliced.blocks
            count = len(sliced.sections) or sliced.blocks  # the graph's parts, and whether they are equal
            equal = len(set(sliced.sections)) <= 1
            if isinstance(parts, int):  # a number of equal parts
                agrees = equal and parts == count
            else:  # the parts' sizes (equal blocks have no sizes recorded: only their number and equality can agree)
                agrees = parts == found if sliced.sections else len(set(parts)) == 1 and len(parts) == count
            if not agrees:
                what = f"pattern {pattern!r} gives {name} the parts {parts}, the graph splits it as {found} part(s)"
                raise DSCompileConfigError(key, what, "fix shape, or drop it: the graph finds the parts")


def apply_layer_specs(
    blocks: list[Block], whole: list[dict[str, Any]], pc: PartitionConfig, weights: list[str], model_type: str | None = None
) -> list[Block]:
    """Keep the blocks that ``layer_specs`` allow; an impossible override is an error naming its pattern."""
    roles = {c.weight: "column" for b in blocks for c in b.columns} | {b.row.weight: "row" for b in blocks}
    for name in weights:
        hit = _spec_for(name, pc.layer_specs, model_type)
        if hit is None or hit[0] == "skip":
            continue
        kind, pattern = hit
        if roles.get(name) != kind:
            found = roles.get(name, "not part of any block the graph lets split")
            raise DSCompileConfigError(
                "tensor_parallel.partition_config.layer_specs",
                f"pattern {pattern!r} asks {name} to be {kind}-parallel, but from the graph it is {found}",
                "fix the pattern or its partition_type (skip keeps a block replicated)",
            )
    kept = []
    for b in blocks:
        names = [c.weight for c in b.columns] + [b.row.weight]
        hits = [_spec_for(n, pc.layer_specs, model_type) for n in names]
        if any(h is not None and h[0] == "skip" for h in hits):
            whole.append({"row": b.row.weight, "columns": names[:-1], "reason": "layer_specs: skip"})
        elif not pc.use_default_specs and any(h is None for h in hits):
            whole.append({"row": b.row.weight, "columns": names[:-1], "reason": "use_default_specs is false and layer_specs do not name every linear"})
        else:
            kept.append(b)
    return kept


# ---------------------------------------------------------------------------------------------
# the rewrite
# ---------------------------------------------------------------------------------------------
def _fake_like(node: fx.Node, shape: list[int]) -> None:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        node.meta["val"] = val.new_empty(shape)


def rewrite(gm: fx.GraphModule, blocks: list[Block], group: Any, tp: int, rank: int) -> dict[str, SliceSpec]:
    """Slice the shapes, make the row linears partial sums + all-reduce, put ``tp_copy`` before each block.

    A block whose units TP does not divide runs on every rank with the largest share of units: this rank's
    own, then zero-weight padding; the row-parallel linear's input is multiplied by a 0/1 mask over the
    padding, so padded units add nothing to the output and get no gradient (their weights stay zero).

    A block with replicated KV heads (``Block.replicas`` > 1) runs each rank on its share of the query heads
    and one KV head: the KV side's sizes are one head's, the repeats ``n_rep / replicas``, and the k/v weights
    go through ``tp_sum_replicas`` (their gradient summed over the ranks holding the same head).
    """
    slices: dict[str, SliceSpec] = {}
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    trainable = _trainable_values(gm)
    for index, b in enumerate(blocks):
        padded = b.units % tp != 0 and b.replicas == 1
        held = padded_units(b.units, tp)

        def local(size: int, node: fx.Node, b: Block = b, held: int = held) -> int:
            if b.replicas > 1:  # one KV head per rank; the query side in T equal shares
                return size // (tp // b.replicas) if node in b.kv else size // tp
            return size // b.units * held

        x = b.columns[0].input
        first = min((c.node for c in b.columns), key=order.__getitem__)
        with graph.inserting_before(first):
            copied = graph.call_function(tp_copy, (x, group))
        copied.meta["val"] = x.meta.get("val")
        copied.meta.setdefault("dscompile", {})["shard"] = "tp_copy"
        for c in b.columns:
            c.node.replace_input_with(x, copied)
        _sum_whole_gradients(graph, b, trainable, group)
        for c in b.columns:
            parts = b.blocks[c.node]
            units = b.units if padded else 0
            replicas = b.replicas if c.node in b.kv else 1
            sections = _cut_sections(b.sections.get(c.node, {}), tp)
            slices[c.weight] = SliceSpec(dim=1 if c.transposed else 0, blocks=parts, units=units, replicas=replicas, sections=sections)
            if c.bias is not None:
                slices[c.bias] = SliceSpec(dim=0, blocks=parts, units=units, replicas=replicas, sections=sections)
            if replicas > 1:
                _sum_replica_gradients(graph, c, group, rank // replicas, tp // replicas)
        for node, (pos, size) in b.rewrites.items():
            if pos == -1:  # split(x, size): each part's size
                node.args = (node.args[0], local(size, node), *node.args[2:])
            elif pos == -2:  # split_with_sizes: every size
                node.args = (node.args[0], [local(s, node) for s in node.args[1]], *node.args[2:])  # type: ignore[union-attr]
            elif pos == -3:  # repeat_interleave's output_size
                node.kwargs = {**node.kwargs, "output_size": local(size, node)}
            else:
                sizes = list(node.args[1])  # type: ignore[arg-type]
                sizes[pos] = local(size, node)
                node.args = (node.args[0], sizes, *node.args[2:])
        for node, (pos, count) in b.repeats.items():  # replicated KV heads: each repeated for this rank's query heads only
            if pos == -1:  # repeat_interleave's repeats
                node.args = (node.args[0], count // b.replicas, *node.args[2:])
            else:  # repeat_kv's expand
                sizes = list(node.args[1])  # type: ignore[arg-type]
                sizes[pos] = count // b.replicas
                node.args = (node.args[0], sizes, *node.args[2:])
        for buffer, dim in b.states.items():
            slices[buffer] = SliceSpec(dim=dim, replicas=b.replicas if buffer in b.replicated_states else 1)
        row = b.row
        slices[row.weight] = SliceSpec(dim=0 if row.transposed else 1, units=b.units if padded else 0)
        node = row.node
        row_input = row.input
        if padded:
            row_input = _mask_padding(gm, row_input, f"_tp_padding_mask_{index}", b.units, rank, tp)
        with graph.inserting_after(node):
            if row.transposed:  # addmm(b, x, W) -> mm(x, W_slice), all-reduce, + b
                partial = graph.call_function(aten.mm.default, (row_input, node.args[2]))
            else:
                partial = graph.call_function(aten.linear.default, (row_input, node.args[1]))
        with graph.inserting_after(partial):
            reduced = graph.call_function(tp_reduce, (partial, group))
        last = reduced
        if row.bias is not None:
            bias_node = node.args[0] if row.transposed else node.args[2]
            with graph.inserting_after(reduced):
                last = graph.call_function(aten.add.Tensor, (reduced, bias_node))
        for n in (partial, reduced, last):
            n.meta["val"] = node.meta.get("val")
        reduced.meta.setdefault("dscompile", {})["shard"] = "tp_reduce"
        node.replace_all_uses_with(last)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return slices


def _cut_sections(cuts: dict[fx.Node, tuple[int, int]], tp: int) -> tuple[int, ...]:
    """The fused parts' sizes, and each slice of the features moved to this rank's parts (each part split in TP)."""
    bounds = sorted(set(cuts.values()))
    for node, cut in cuts.items():
        i = bounds.index(cut)
        start = sum(b - a for a, b in bounds[:i]) // tp
        node.args = (node.args[0], node.args[1], start, start + (cut[1] - cut[0]) // tp, *node.args[4:])
    return tuple(b - a for a, b in bounds)


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _trainable_values(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes whose value depends on a trainable parameter (so a gradient flows back through them)."""
    out: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = _attr(gm, str(node.target))
            if isinstance(value, nn.Parameter) and value.requires_grad:
                out.add(node)
        elif any(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def _sum_whole_gradients(graph: fx.Graph, b: Block, trainable: set[fx.Node], group: Any) -> None:
    """A whole value the block's sliced ops read and that carries a gradient (Qwen3's per-head norm weights, the
    block input read elsewhere than by its linears) gets on each rank only its heads' part of the gradient: it is
    read through ``tp_copy``, whose backward sums the parts over the TP group."""
    copies: dict[fx.Node, fx.Node] = {}
    for node in b.region:
        for value in node.all_input_nodes:
            if value in b.sharded or value not in trainable or getattr(value, "target", None) is tp_copy:
                continue
            if value not in copies:
                b.summed |= {str(p.target) for p in _ancestors(value) if p.op == "get_attr" and p in trainable}
                with graph.inserting_after(value):
                    copies[value] = graph.call_function(tp_copy, (value, group))
                copies[value].meta["val"] = value.meta.get("val")
                copies[value].meta.setdefault("dscompile", {})["shard"] = "tp_copy"
            node.replace_input_with(value, copies[value])


def _sum_replica_gradients(graph: fx.Graph, column: Linear, group: Any, slot: int, slots: int) -> None:
    """The column reads its weight (and bias) through ``tp_sum_replicas``: the ranks sharing a KV head each hold a
    copy, and each computes only its query heads' part of its gradient."""
    for name in (column.weight, column.bias):
        if name is None:
            continue
        attr = next(a for a in column.node.all_input_nodes if a.op == "get_attr" and a.target == name)
        with graph.inserting_before(column.node):
            summed = graph.call_function(tp_sum_replicas, (attr, group, slot, slots))
        summed.meta["val"] = attr.meta.get("val")
        summed.meta.setdefault("dscompile", {})["shard"] = "tp_sum_replicas"
        column.node.replace_input_with(attr, summed)


def _mask_padding(gm: fx.GraphModule, x: fx.Node, name: str, units: int, rank: int, tp: int) -> fx.Node:
    """``x * mask``: ones over this rank's units of the last dimension, zeros over its padding."""
    val = x.meta["val"]  # still the unsplit value
    unit = int(val.shape[-1]) // units
    local_features = unit * padded_units(units, tp)
    mask = torch.zeros(local_features, dtype=val.dtype, device=val.device)
    mask[: units_of_rank(units, rank, tp)[1] * unit] = 1
    gm.register_buffer(name, mask)
    with gm.graph.inserting_after(x):
        attr = gm.graph.get_attr(name)
    with gm.graph.inserting_after(attr):
        masked = gm.graph.call_function(aten.mul.Tensor, (x, attr))
    attr.meta["val"] = val.new_empty(local_features)
    masked.meta["val"] = val
    masked.meta.setdefault("dscompile", {})["shard"] = "tp_padding_mask"
    return masked


def partition_parameters(model: nn.Module, slices: dict[str, SliceSpec], rank: int, tp: int) -> None:
    """Each parameter named in ``slices`` keeps only this rank's slice (same ``nn.Parameter`` object)."""
    with torch.no_grad():
        for name, spec in slices.items():
            p = model.get_parameter(name)
            p.data = spec.take(p.data, rank, tp).clone()


def _share_parameters(gm: fx.GraphModule, model: nn.Module) -> None:
    """The exported module reads the model's own ``nn.Parameter`` objects (those the optimizer steps)."""
    for name, _ in list(gm.named_parameters(remove_duplicate=False)):
        owner, _, leaf = name.rpartition(".")
        setattr(gm.get_submodule(owner) if owner else gm, leaf, model.get_parameter(name))


@contextlib.contextmanager
def _without_kv_cache(model: nn.Module) -> Iterator[None]:
    """Hugging Face models build a KV cache (a ``DynamicCache``) and return it, in training mode too.
    ``torch.export`` cannot return that object, and the split graph could not return it whole: each rank holds
    only its heads' keys and values, and returning them would pin every block's keys and values as outputs.
    Training and evaluation (a loss, logits) never read it, so the model is captured with ``use_cache`` off
    (in both modes; an explicit ``use_cache=True`` argument is turned off by ``without_cache_request``) and its
    outputs carry ``past_key_values=None``."""
    configs = {id(c): c for m in model.modules() if getattr(c := getattr(m, "config", None), "use_cache", None) is True}
    if configs:
        log.info("capturing %s with Hugging Face's use_cache off: the split graph returns no KV cache", type(model).__name__)
    for config in configs.values():
        config.use_cache = False
    try:
        yield
    finally:
        for config in configs.values():
            config.use_cache = True


def without_cache_request(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with an explicit ``use_cache=True`` turned off, said once in the log: under tensor parallelism
    the model's outputs carry ``past_key_values=None`` (see ``_without_kv_cache``)."""
    if kwargs.get("use_cache") is not True:
        return kwargs
    if not getattr(without_cache_request, "said", False):
        log.warning(
            "tensor_parallel: use_cache=True has no effect in the engine: each rank holds only its attention heads' keys and values, "
            "so outputs carry past_key_values=None (losses and logits are unchanged); generate with dscompile.init_inference "
            "(tensor_parallel.tp_size) for a KV cache"
        )
        without_cache_request.said = True  # type: ignore[attr-defined]
    return {**kwargs, "use_cache": False}


def capture(model: nn.Module, args: tuple, kwargs: dict) -> fx.GraphModule:
    """The model's ATen graph at these inputs' shapes (``torch.export``, non-strict)."""
    with _without_kv_cache(model):
        exported = torch.export.export(model, tuple(args), without_cache_request(dict(kwargs)), strict=False)
    gm = exported.module()
    _share_parameters(gm, model)
    for node in list(gm.graph.nodes):  # export's dtype/device asserts: checks of the capture, not computation
        if node.target is aten._assert_tensor_metadata.default and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()
    return gm


def split_entry(b: Block, tp: int) -> dict[str, Any]:
    """A split block in the plan: its linears, and, when it has fewer KV heads than ranks, which are replicated."""
    entry: dict[str, Any] = {"row": b.row.weight, "columns": [c.weight for c in b.columns]}
    if b.replicas > 1:
        kv = [c.weight for c in b.columns if c.node in b.kv]
        entry["kv_replicated"] = {"columns": kv, "kv_heads": tp // b.replicas, "ranks_per_kv_head": b.replicas}
    return entry


def parallelize(model: nn.Module, args: tuple, kwargs: dict, groups: ProcessGroups, tc: TensorParallelConfig) -> tuple[fx.GraphModule, TensorParallelPlan]:
    """Capture, find the blocks, rewrite the graph and partition ``model``'s parameters in place."""
    tp = groups.tp_size
    gm = capture(model, args, kwargs)
    from dscompile.passes.tensor_parallel.sequence import find_sequence, shard_sequence  # it builds on this module

    seq = find_sequence(gm, tp) if tc.sequence_parallel else None
    blocks, whole = find_blocks(gm, tp)
    weights = [n for n, _ in model.named_parameters()]
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    blocks = apply_layer_specs(blocks, whole, tc.partition_config, weights, model_type)
    if not blocks:
        reasons = "; ".join(f"{w['row']}: {w['reason']}" for w in whole) or "no linear adds to a residual stream"
        raise DSCompileConfigError(
            "tensor_parallel.autotp_size",
            f"no transformer block of {type(model).__name__} can be split across {tp} ranks ({reasons})",
            "use a TP size that divides the heads and hidden sizes, or turn tensor_parallel off",
        )
    plan = TensorParallelPlan(tp)
    group_name = groups.tp_group.group_name if groups.tp_group is not None else ""
    plan.slices = rewrite(gm, blocks, group_name, tp, groups.tp_rank)
    plan.split = [split_entry(b, tp) for b in blocks]
    plan.replicated = whole
    canonical: dict[int, str] = {}
    for name, p in model.named_parameters():  # tied weights: the name the model lists first
        canonical.setdefault(id(p), name)
    names = {target: canonical[id(p)] for target, p in gm.named_parameters(remove_duplicate=False) if id(p) in canonical}
    summed = {names.get(target, target) for b in blocks for target in b.summed}
    check_layer_specs(plan.slices, summed, tc.partition_config, weights, model_type)
    if tc.vocab_parallel_lm_head:
        heads, plan.vocab_replicated = find_vocab_heads(gm)
        plan.slices |= rewrite_vocab_heads(gm, heads, group_name, tp, groups.tp_rank, names)
        plan.vocab = [{"weight": names.get(str(h.linear.node.args[1].target)), "vocab": h.vocab, "embeddings": len(h.embeddings)} for h in heads]
    if seq is not None:
        plan.sequence_parallel = shard_sequence(gm, seq, group_name, tp, groups.tp_rank)
    partition_parameters(model, plan.slices, groups.tp_rank, tp)
    return gm, plan


# ---------------------------------------------------------------------------------------------
# the engine's part
# ---------------------------------------------------------------------------------------------
class TensorParallelModule(nn.Module):
    """What the engine runs: at the first batch, capture and split the model; then the split graph.

    Every rank of a TP group must see the same batch: the tensors of each batch are broadcast from the
    group's first rank (DeepSpeed leaves this to the data loader, and gets it wrong silently when it is).
    """

    def __init__(self, model: nn.Module, groups: ProcessGroups, tc: TensorParallelConfig, compile_options: Any, after_split: Any = None) -> None:
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
        tensors = {name: _attr(self.model, name) for name in specs}
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
            graph = torch.compile(run, backend="dscompile", options=self.compile_options) if self.compile_options is not None else run
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


def refuse_untested_compositions(engine: EngineCore) -> None:
    """What tensor parallelism is not built to combine with yet: a clear error, never a silently wrong step."""
    sections = engine.config.sections
    zero = sections.get("zero_optimization")
    clashes = {
        "zero_optimization.offload_optimizer": zero is not None and getattr(zero.offload_optimizer, "enabled", False),
        "pipeline": sections.get("pipeline_parallel") is not None or engine.runs_pipeline,
    }
    for key, clash in clashes.items():
        if clash:
            raise DSCompileConfigError(SECTION, f"tensor parallelism together with {key} is not built yet", f"remove {key} or the tensor_parallel section")
    refuse_layouts_per_head(sections, "tensor parallelism", "turn tensor_parallel off")


def refuse_layouts_per_head(sections: Mapping[str, Any], parallelism: str, fix: str) -> None:
    """Under tensor or sequence parallelism each rank's attention holds a share of the heads, and the sparse
    attention pass would give it the first heads' layouts: a layout per head is refused, not silently wrong."""
    sparse = sections.get("sparse_attention")
    if sparse is not None and getattr(sparse, "different_layout_per_head", False):
        raise DSCompileConfigError(
            "sparse_attention.different_layout_per_head",
            f"a layout per head under {parallelism} (each rank attends with a share of the heads) is not built",
            f"set different_layout_per_head to false, or {fix}",
        )


class TensorParallelExtension(EngineExtension):
    """Lays out the groups, wraps the model, and installs data parallelism over the DP group only."""

    name = "tensor_parallel"

    def __init__(self, tc: TensorParallelConfig) -> None:
        self.tc = tc
        self.groups: ProcessGroups | None = None
        self.module: TensorParallelModule | None = None

    def configure(self, engine: EngineCore) -> None:
        refuse_untested_compositions(engine)
        groups = process_groups_for(self.tc.autotp_size)  # those tp_model_init laid out, or new ones
        self.groups = groups
        if engine.world_size > 1:
            with torch.no_grad():  # every rank slices the same full weights
                for tensor in list(engine.module.parameters()) + list(engine.module.buffers()):
                    dist.broadcast(tensor, src=0)
        # the split graph compiles under the engine's config, less this section (the frontend refuses it on its own)
        options = dataclasses.replace(engine.config, sections=split_graph_sections(engine.config.sections))
        options = options if engine.compiles_model else None
        engine.compiles_model = False  # the module compiles its split graph itself
        self.module = TensorParallelModule(engine.module, groups, self.tc, options, self._after_split)
        engine.compile_target = self.module
        engine.process_groups = groups
        engine.gradients = TensorParallelGradients(engine.module, groups, self.slices, defer_optimizer=self._defer_optimizer)
        self.engine = engine
        self._pending: Any = None  # a checkpoint's optimizer states (and generators) loaded before the first batch split the model
        # extensions that partition parameters themselves (ZeRO) append here: run once the model is split, each
        # takes the module that runs the split graph and returns the one to run (ZeRO-2/3 wrap it over their shards)
        engine.after_parameters_split = []

    def _after_split(self, split: nn.Module) -> nn.Module:
        """Run the extensions waiting for the split parameters; each may wrap the module that runs (ZeRO-2/3)."""
        engine = self.engine
        for callback in engine.after_parameters_split or ():
            split = callback(split)
        if not isinstance(engine.gradients, TensorParallelGradients):  # ZeRO-1 took over: gather its TP slices too
            engine.gradients = TensorParallelOver(engine.gradients, self.groups, self.slices)  # type: ignore[arg-type]
        if self._pending is not None:
            assert self.groups is not None
            restore_optimizer(engine, self._pending, self.slices(), self.groups)
            self._pending = None
        return split

    def _defer_optimizer(self, full: Any) -> None:
        """``load_checkpoint`` before the first batch: the optimizer states wait until the slices (and shards) exist."""
        self._pending = full

    @property
    def plan(self) -> TensorParallelPlan | None:
        """The pass's decisions (None until the first batch captured the graph)."""
        return self.module.plan if self.module is not None else None

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every parameter's gradient at the unpartitioned shape (a collective over the TP group): for checks."""
        assert self.groups is not None and self.module is not None
        specs = self.slices()
        out = {}
        for name, p in self.module.model.named_parameters():
            if p.grad is not None:
                g = p.grad.detach()
                out[name] = specs[name].assemble(gather_slices(g, self.groups)) if name in specs else g.clone()
        return out

    def slices(self) -> dict[str, SliceSpec]:
        return self.module.plan.slices if self.module is not None and self.module.plan is not None else {}

    def counters(self) -> dict[str, Any]:
        plan = self.module.plan if self.module is not None else None
        if plan is None:
            return {}
        out = {"tp_size": plan.tp_size, "blocks_split": len(plan.split), "blocks_replicated": len(plan.replicated)}
        if plan.sequence_parallel is not None:
            sp = plan.sequence_parallel
            gathers = sp["all_gathers_before_blocks"] + sp["all_gathers_for_readers"]
            out |= {"sequence_parallel": True, "sp_reduce_scatters": sp["reduce_scatters"], "sp_all_gathers": gathers}
        return out


@register_engine_extension(8, "tensor_parallel")
def _tensor_parallel_extension(config: Any) -> EngineExtension | None:
    tc = tensor_parallel_config(config)
    return TensorParallelExtension(tc) if tc is not None else None


from dscompile.passes.tensor_parallel import overlap as _overlap  # noqa: E402,F401  # registers the tp_overlap pass
