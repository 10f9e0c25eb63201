"""``deepspeed.pipe``: ``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec`` over dscompile's pipeline engine.

A ``PipelineModule`` is a list of layers run in sequence. ``dscompile.initialize(model=
PipelineModule(...))`` returns the ``PipelineEngine`` (``train_batch``/``eval_batch``), which
captures the module's graph and cuts it into stages. The module translates DeepSpeed's arguments
into that engine's terms:

- ``num_stages`` (or ``topology``'s pipe dimension) becomes ``pipeline.stages``;
- ``partition_method`` (``parameters``, ``uniform``, ``type:REGEX``) is applied to the layer list,
  balanced by ``passes.pipeline_split.min_max_partition``, and the chosen boundaries become
  ``dscompile.pipeline_split()`` markers in ``forward``, which the engine cuts at;
- ``loss_fn(outputs, labels)`` becomes the engine's ``loss_fn``;
- ``activation_checkpoint_interval > 0`` becomes ``pipeline.activation_checkpoint_interval``:
  the engine recomputes whole stages (the gradients are the same as checkpointing every
  ``interval`` layers; only the memory saved differs);
- ``TiedLayerSpec``s with one ``key`` share one module; the engine finds the shared parameters in
  the graph and sums their gradients over the stages that use them.

Differences from DeepSpeed, by design: every rank builds every layer (DeepSpeed builds only its
own), then the engine frees the other stages' parameters. Ranks are laid out as DeepSpeed's topologies lay
them out (pipe, data, model: ``dscompile.planner.ParallelLayout``); a ``PipeModelDataParallelTopology`` with
``num_mp`` > 1 turns on tensor parallelism inside the stages (``tensor_parallel.autotp_size``); with
``seed_layers`` layers are built under DeepSpeed's seeds (``base_seed + index``) but the forward is not re-seeded per
layer, so dropout masks differ from DeepSpeed's.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from dscompile.config import DSConfig, parse_dataclass
from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError
from dscompile.runtime.dataloader import set_random_seed
from dscompile.runtime.pipeline_markers import pipeline_split

log = logging.getLogger("dscompile.pipe")

__all__ = ["LayerSpec", "PipeDataParallelTopology", "PipelineModule", "ProcessTopology", "TiedLayerSpec"]


class LayerSpec:
    """A layer to build later: ``typename(*module_args, **module_kwargs)``."""

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise DSCompileConfigError("LayerSpec", f"{typename!r} is not an nn.Module class", "pass the class, e.g. LayerSpec(nn.Linear, 8, 8)")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"


class TiedLayerSpec(LayerSpec):
    """A layer shared by every spec with the same ``key`` (e.g. input embedding and output head).

    ``forward_fn(module, inputs)`` replaces ``module(inputs)`` where given. ``tied_weight_attr``
    names the shared weights, as in DeepSpeed; here the whole module is one instance, so a tied
    module's other parameters are shared as well (DeepSpeed keeps one copy of those per stage).
    """

    def __init__(
        self,
        key: str,
        typename: type[nn.Module],
        *module_args: Any,
        forward_fn: Callable[..., Any] | None = None,
        tied_weight_attr: str | Sequence[str] = ("weight",),
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


class ProcessTopology:
    """Named axes of a grid of ranks; only the sizes matter to dscompile (``get_dim``)."""

    def __init__(self, axes: Sequence[str], dims: Sequence[int]) -> None:
        if len(axes) != len(dims):
            raise DSCompileConfigError("topology", f"{len(axes)} axes but {len(dims)} sizes")
        self.axes = list(axes)
        self.dims = [int(d) for d in dims]

    def get_dim(self, axis: str) -> int:
        return self.dims[self.axes.index(axis)] if axis in self.axes else 1

    def world_size(self) -> int:
        size = 1
        for d in self.dims:
            size *= d
        return size


class PipeDataParallelTopology(ProcessTopology):
    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(["pipe", "data"], [num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Megatron-DeepSpeed's 3D grid. ``num_mp`` > 1 runs dscompile's tensor parallelism found from the graph inside
    every stage (as ``tensor_parallel.autotp_size = num_mp``). The pipeline engine lays ranks out in the same order
    (pipe, data, model: ``dscompile.planner.ParallelLayout``), so its pipelines, data-parallel and TP groups hold the
    same ranks as DeepSpeed's."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(["pipe", "data", "model"], [num_pp, num_dp, num_mp])


def _class_name(layer: Any) -> str:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", "")


def _trainable(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


class PipelineModule(nn.Module):
    """Layers run one after another; ``dscompile.initialize`` turns it into a pipeline engine."""

    def __init__(
        self,
        layers: Iterable[Any],
        num_stages: int | None = None,
        topology: ProcessTopology | None = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], None] | None = None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable[..., Any] | None = None,
        checkpointable_layers: list[str] | None = None,
        dynamic_shape: bool = False,
    ) -> None:
        super().__init__()
        if num_stages is None and topology is None:
            raise DSCompileConfigError("PipelineModule", "needs num_stages or topology", "pass num_stages=N")
        if topology is not None:
            topo_stages = topology.get_dim("pipe")
            if num_stages is not None and num_stages != topo_stages:
                raise DSCompileConfigError("PipelineModule.num_stages", f"{num_stages} contradicts the topology's {topo_stages} pipe stages")
            num_stages = topo_stages
        assert num_stages is not None
        if num_stages < 1:
            raise DSCompileConfigError("PipelineModule.num_stages", f"must be >= 1, got {num_stages}")
        if activation_checkpoint_interval < 0:
            raise DSCompileConfigError("PipelineModule.activation_checkpoint_interval", "must be >= 0 (0 turns it off)")
        self.num_stages = num_stages
        self._topo = topology
        self.loss_fn = loss_fn
        self.seed_layers = seed_layers
        self.base_seed = base_seed
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.checkpointable_layers = checkpointable_layers
        self.dynamic_shape = dynamic_shape
        self._layer_specs = list(layers)
        if not self._layer_specs:
            raise DSCompileConfigError("PipelineModule.layers", "is empty")
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.forward_funcs: list[Callable[..., Any]] = []
        for index, layer in enumerate(self._layer_specs):
            if seed_layers:
                (seed_fn or set_random_seed)(base_seed + index)
            self.forward_funcs.append(self._build_layer(index, layer))
        if seed_layers:
            log.warning("PipelineModule(seed_layers=True): layers are built under DeepSpeed's seeds, but the forward is not re-seeded per layer")
        self._bounds = self.partition_layers(num_stages)

    def _build_layer(self, index: int, layer: Any) -> Callable[..., Any]:
        if isinstance(layer, PipelineModule):
            raise DSCompileNotSupportedError("PipelineModule.layers", "a PipelineModule inside a PipelineModule")
        if isinstance(layer, TiedLayerSpec):
            if layer.key not in self.tied_modules:
                self.tied_modules[layer.key] = layer.build()
                self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
            module = self.tied_modules[layer.key]
            return module if layer.forward_fn is None else partial(layer.forward_fn, module)
        if isinstance(layer, LayerSpec):
            layer = layer.build()
        if isinstance(layer, nn.Module):
            self.add_module(str(index), layer)  # DeepSpeed's parameter names: "<layer index>.<name>"
            return layer
        if callable(layer):
            return layer
        raise DSCompileConfigError(f"PipelineModule.layers[{index}]", f"{type(layer).__name__} is not a layer", "use an nn.Module, a LayerSpec or a function")

    # -- partitioning --------------------------------------------------------------------------
    def _layer_weights(self) -> list[float]:
        method = self.partition_method.lower()
        if method == "uniform":
            return [1.0] * len(self._layer_specs)
        if method == "parameters":
            return [float(_trainable(f) if isinstance(f, nn.Module) else 0) for f in self._built_layers()]
        if method.startswith("type:"):
            pattern = re.compile(self.partition_method[5:], re.IGNORECASE)
            weights = [1.0 if pattern.search(_class_name(layer)) else 0.0 for layer in self._layer_specs]
            if not any(weights):
                raise DSCompileConfigError("PipelineModule.partition_method", f"no layer class matches {self.partition_method[5:]!r}")
            return weights
        raise DSCompileNotSupportedError(
            f"PipelineModule.partition_method={self.partition_method!r}", "partition methods other than parameters, uniform and type:REGEX"
        )

    def _built_layers(self) -> list[Any]:
        return [f.args[0] if isinstance(f, partial) else f for f in self.forward_funcs]

    def partition_layers(self, pieces: int) -> list[int]:
        """Layer-index boundaries ``[0, ..., len(layers)]`` of ``pieces`` stages by ``partition_method``."""
        from dscompile.passes.pipeline_split import min_max_partition

        n = len(self._layer_specs)
        if pieces > n:
            raise DSCompileConfigError("PipelineModule.num_stages", f"{pieces} stages but only {n} layers", "use fewer stages or more layers")
        weights = self._layer_weights()
        even = 1e-6 * max(sum(weights), 1.0) / n  # ties between equal splits go to the most even layer counts
        return min_max_partition([w + even for w in weights], [0.0] * (n + 1), pieces)

    def topology(self) -> ProcessTopology | None:
        return self._topo

    def partitions(self) -> list[int]:
        return list(self._bounds)

    # -- what dscompile.initialize asks of it --------------------------------------------------
    def configure_pipeline(self, config: DSConfig) -> DSConfig:
        """Give ``config`` the pipeline section this module implies (stages, checkpointing), and
        place the stage boundaries for its ``stages * virtual_stages`` pieces."""
        from dscompile.passes.pipeline_split import PipelineParallelConfig

        raw = config.raw.get("pipeline")
        raw = dict(raw) if isinstance(raw, dict) else {}
        stages = raw.get("stages", "auto")
        if stages != "auto" and stages != self.num_stages:
            raise DSCompileConfigError("pipeline.stages", f"{stages} contradicts PipelineModule(num_stages={self.num_stages})", 'drop it or set "auto"')
        raw["stages"] = self.num_stages
        if not raw.get("activation_checkpoint_interval"):
            raw["activation_checkpoint_interval"] = self.activation_checkpoint_interval  # DeepSpeed: the config's wins when > 0
        section = parse_dataclass(PipelineParallelConfig, raw, "pipeline")
        for key in ("split_points", "partition_method"):
            if key in raw:
                raise DSCompileConfigError(f"pipeline.{key}", "a PipelineModule cuts its stages by its own partition_method", f"drop {key}")
        self._bounds = self.partition_layers(section.num_model_stages)
        config.sections["pipeline_parallel"] = section
        num_mp = self._topo.get_dim("model") if self._topo is not None else 1
        if num_mp > 1:  # tensor parallelism inside the stages, as tp_model_init records it
            import torch.distributed as dist

            from dscompile.autotp import TpModelInit, merge_into_config

            assert self._topo is not None
            world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
            if world is not None and world != self._topo.world_size():
                raise DSCompileConfigError(
                    "PipelineModule.topology",
                    f"{self._topo.world_size()} ranks ({dict(zip(self._topo.axes, self._topo.dims))}) but the world has {world}",
                    "make num_pp * num_mp * num_dp the number of processes launched",
                )

            config = merge_into_config(config, TpModelInit(num_mp, None), source=f"the PipelineModule's topology (num_mp={num_mp})")
        return config

    def forward(self, *inputs: Any) -> Any:
        x: Any = inputs[0] if len(inputs) == 1 else inputs
        cuts = set(self._bounds[1:-1])
        for index, fn in enumerate(self.forward_funcs):
            if index in cuts:
                pipeline_split()  # the engine cuts its stages here (a no-op outside the pipeline engine)
            x = fn(x)
        return x
