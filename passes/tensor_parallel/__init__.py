"""Tensor parallelism found from the graph: Megatron-style sharding of every transformer block the pass sees.

One module per job (README.md has the layout and the rules); importing the package registers the config section,
the engine extension and the ``tp_overlap`` pass. The names other code imports are re-exported here.
"""

from __future__ import annotations

from dscompile.passes.tensor_parallel.blocks import Block, Linear, find_blocks
from dscompile.passes.tensor_parallel.config import (
    LayerSpec,
    PartitionConfig,
    TensorParallelConfig,
    parse_tensor_parallel,
    split_graph_sections,
    tensor_parallel_config,
)
from dscompile.passes.tensor_parallel.extension import TensorParallelExtension, refuse_layouts_per_head, refuse_untested_compositions
from dscompile.passes.tensor_parallel.graph_facts import SECTION
from dscompile.passes.tensor_parallel.layer_specs import apply_layer_specs, check_layer_specs
from dscompile.passes.tensor_parallel.module import TensorParallelModule
from dscompile.passes.tensor_parallel.overlap import tp_overlap
from dscompile.passes.tensor_parallel.rewrite import rewrite
from dscompile.passes.tensor_parallel.split import TensorParallelPlan, capture, parallelize, partition_parameters, without_cache_request
from dscompile.passes.tensor_parallel.vocab import VocabHead, find_vocab_heads, rewrite_vocab_heads

__all__ = [
    "SECTION",
    "Block",
    "LayerSpec",
    "Linear",
    "PartitionConfig",
    "TensorParallelConfig",
    "TensorParallelExtension",
    "TensorParallelModule",
    "TensorParallelPlan",
    "VocabHead",
    "apply_layer_specs",
    "capture",
    "check_layer_specs",
    "find_blocks",
    "find_vocab_heads",
    "parallelize",
    "parse_tensor_parallel",
    "partition_parameters",
    "refuse_layouts_per_head",
    "refuse_untested_compositions",
    "rewrite",
    "rewrite_vocab_heads",
    "split_graph_sections",
    "tensor_parallel_config",
    "tp_overlap",
    "without_cache_request",
]
