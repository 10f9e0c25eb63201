"""Checkpoints of tensor parallelism, with or without ZeRO over the data-parallel group, in DeepSpeed's layout.

Why a module of its own: a TP checkpoint is several partitionings at once (the TP slices, and under
ZeRO each slice's shards over its DP group), and users load it into an engine laid out differently
(another TP size, another DP size or ZeRO stage, no TP at all), often *before* the first batch, when
the graph pass has not yet decided the slices. So every load goes through the whole model's state:

- **Saving** under ZeRO: each TP rank's ZeRO group writes a ZeRO checkpoint of its slices under
  DeepSpeed's model-parallel names (``mp_rank_XX_model_states.pt`` from the group's first rank,
  ``zero_pp_rank_D_mp_rank_XX_optim_states.pt`` from every rank) with the slicing in its metadata.
  Without ZeRO, one ``mp_rank_XX_model_states.pt`` per TP rank (``TensorParallelGradients``).
- **Reading** (``full_state``): each TP rank's state (its ZeRO shards joined, or its file) and then the
  TP slices joined (``SliceSpec.assemble``, padding dropped), parameters *and* the optimizer's
  element-wise states (Adam's moments are sliced as their parameters are).
- **Loading** (``load``): the whole state cut to this rank's slices (``sliced_state``) and restored as
  any full state is (``zero_checkpoint.restore_full_state``: into ZeRO shards or whole parameters).
  Before the first batch the weights go into the unsplit model (the split then slices them) and the
  optimizer states wait for the split (``restore_optimizer``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dscompile.runtime.checkpoint_io import CheckpointReader
from dscompile.runtime.process_groups import ProcessGroups
from dscompile.runtime.tensor_parallel import SliceSpec, slicing_metadata, tp_file_name
from dscompile.runtime.zero_checkpoint import (
    FullState,
    _load_full_optimizer,
    _restore_rng,
    full_state_of_stage0,
    full_state_of_zero,
    restore_full_state,
    save,
    shard_name,
)


def save_under_zero(engine: Any, ckpt: Any, client_state: dict | None, groups: ProcessGroups, specs: dict[str, SliceSpec]) -> None:
    """This rank's ZeRO shard file of its TP slices (and the TP rank's metadata from its DP group's first rank)."""
    save(engine, ckpt, client_state, mp_rank=groups.tp_rank, extra={"tensor_parallel": slicing_metadata(groups, specs)})


def _rank_state(reader: CheckpointReader, tp_rank: int, engine: Any | None) -> FullState:
    """The state one TP rank held: its slices, by parameter name, with its optimizer's states."""
    if "zero" in reader.load(tp_file_name(tp_rank)):
        return full_state_of_zero(reader, mp_rank=tp_rank)
    return full_state_of_stage0(reader, engine, tp_file_name(tp_rank))


def _specs_by_every_name(tensors: dict[str, torch.Tensor], specs: dict[str, SliceSpec]) -> dict[str, SliceSpec]:
    """``specs`` extended to tied names: a name whose tensor is a sliced one's (same storage and shape) shares its spec."""
    out = dict(specs)
    keyed = {(t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)): n for n, t in tensors.items() if n in specs}
    for name, t in tensors.items():
        twin = keyed.get((t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)))
        if name not in out and twin is not None:
            out[name] = specs[twin]
    return out


def _map_optimizer(
    optimizer: dict[str, dict[str, Any]] | None, shapes: dict[str, torch.Size], cut: Callable[[str, str, torch.Size], torch.Tensor | None]
) -> dict[str, dict[str, Any]] | None:
    """Each element-wise state (a tensor of its parameter's size) replaced by ``cut(name, key, shape)``; others kept."""
    if optimizer is None:
        return None
    out: dict[str, dict[str, Any]] = {}
    for name, entries in optimizer.items():
        out[name] = {}
        for key, value in entries.items():
            shape = shapes.get(name)
            new = cut(name, key, shape) if shape is not None and isinstance(value, torch.Tensor) and value.numel() == shape.numel() > 1 else None
            out[name][key] = value if new is None else new
    return out


def specs_of(meta: dict[str, Any]) -> dict[str, SliceSpec]:
    """The ``SliceSpec`` of every sliced tensor, from a checkpoint's ``slicing_metadata``."""
    return {n: SliceSpec.from_dict(s) for n, s in meta["slices"].items()}


def join_tp_ranks(ranks: list[FullState], saved: dict[str, SliceSpec], source: str) -> FullState:
    """The whole state from every TP rank's state (rank order): each sliced tensor, and each element-wise optimizer
    state of a sliced parameter, joined by its ``SliceSpec`` (padding dropped); the others taken from rank 0."""
    first = ranks[0]
    specs = _specs_by_every_name({**first.params, **first.module_extra}, saved)

    def join(name: str, values: list[torch.Tensor]) -> torch.Tensor:
        return specs[name].assemble(values) if name in specs else values[0]

    def join_state(name: str, key: str, shape: torch.Size) -> torch.Tensor | None:
        if name not in specs:
            return None
        return specs[name].assemble([r.optimizer[name][key].reshape(shape) for r in ranks]).reshape(-1)  # type: ignore[index]

    return dataclasses.replace(
        first,
        source=source,
        params={n: join(n, [r.params[n] for r in ranks]) for n in first.params},
        module_extra={n: join(n, [r.module_extra[n] for r in ranks]) for n in first.module_extra},
        optimizer=_map_optimizer(first.optimizer, {n: v.shape for n, v in first.params.items()}, join_state),
        rng=None,  # a rank's generators belong to its place in the saved layout: restored only onto the same one
    )


def full_state(reader: CheckpointReader, engine: Any | None) -> FullState:
    """The whole model's state from a TP checkpoint: every TP rank's state, its slices joined."""
    first_file = reader.load(tp_file_name(0))
    meta, zero = first_file["tensor_parallel"], first_file.get("zero")
    tp = int(meta["tp_size"])
    ranks = [_rank_state(reader, r, engine) for r in range(tp)]
    under = f", ZeRO-{zero['stage']} over {zero['world_size']} rank(s) each" if zero else ""
    return join_tp_ranks(ranks, specs_of(meta), f"dscompile tensor-parallel checkpoint (TP={tp}{under})")


def sliced_state(full: FullState, module: nn.Module, specs: dict[str, SliceSpec], groups: ProcessGroups) -> FullState:
    """``full`` cut to this rank's TP slices, as the split model holds them (tied names included)."""
    live = dict(module.named_parameters(remove_duplicate=False)) | dict(module.named_buffers(remove_duplicate=False))
    return cut_to_rank(full, {n: t.data for n, t in live.items()}, specs, groups.tp_rank, groups.tp_size)


def cut_to_rank(full: FullState, live: dict[str, torch.Tensor], specs: dict[str, SliceSpec], rank: int, tp: int) -> FullState:
    """``full`` cut to TP rank ``rank``'s slices of ``tp`` (``specs``: the loading model's slicing; ``live``: its tensors
    by every name, so that tied names share their twin's spec); element-wise optimizer states cut as their parameters."""
    by_name = _specs_by_every_name(live, specs)

    def cut(name: str, value: torch.Tensor) -> torch.Tensor:
        return by_name[name].take(value, rank, tp).clone() if name in by_name else value

    def cut_state(name: str, key: str, shape: torch.Size) -> torch.Tensor | None:
        return cut(name, full.optimizer[name][key].reshape(shape)).reshape(-1) if name in by_name else None  # type: ignore[index]

    return dataclasses.replace(
        full,
        params={n: cut(n, v) for n, v in full.params.items()},
        module_extra={n: cut(n, v) for n, v in full.module_extra.items()},
        optimizer=_map_optimizer(full.optimizer, {n: v.shape for n, v in full.params.items()}, cut_state),
    )


def _own_rng(reader: CheckpointReader, groups: ProcessGroups) -> dict | None:
    """This rank's saved generators when the checkpoint was laid out as this engine is (same TP and DP sizes)."""
    meta = reader.load(tp_file_name(0))
    if meta.get("tensor_parallel", {}).get("tp_size") != groups.tp_size:
        return None
    if "zero" in meta:
        if meta["zero"]["world_size"] != groups.dp_size:
            return None
        return reader.load(shard_name(groups.dp_rank, groups.tp_rank))["rng"]
    return reader.load(tp_file_name(groups.tp_rank)).get("rng")


def load(
    engine: Any,
    directory: Any,
    full: FullState,
    kind: str,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    load_module_only: bool,
    groups: ProcessGroups,
    specs: dict[str, SliceSpec],
    defer_optimizer: Callable[[FullState], None] | None,
) -> dict:
    """Restore any checkpoint (``full``, read from ``directory``, of ``checkpoint_formats.checkpoint_kind``
    ``kind``) into a TP engine (split or not yet); returns the client state.

    ``specs`` empty means the first batch has not split the model: the whole weights are loaded now and the
    optimizer states handed to ``defer_optimizer`` (restored by ``restore_optimizer`` once split).
    """
    if kind == "dscompile-tp":
        full = dataclasses.replace(full, rng=_own_rng(CheckpointReader(directory), groups))
    if specs:
        restore_full_state(engine, sliced_state(full, engine.module, specs, groups), load_optimizer_states, load_lr_scheduler_states, load_module_only)
        return full.client_state
    wants_optimizer = load_optimizer_states and not load_module_only and engine.optimizer is not None and full.optimizer is not None
    if wants_optimizer and defer_optimizer is None:
        raise RuntimeError("this tensor-parallel engine cannot restore optimizer states before its model is split: run one batch first")
    restore_full_state(engine, dataclasses.replace(full, rng=None), False, load_lr_scheduler_states, load_module_only)
    if wants_optimizer or (full.rng is not None and not load_module_only):
        defer_optimizer(dataclasses.replace(full, optimizer=full.optimizer if wants_optimizer else None))  # type: ignore[misc]
    return full.client_state


def restore_optimizer(engine: Any, full: FullState, specs: dict[str, SliceSpec], groups: ProcessGroups) -> None:
    """Once the first batch split the model (and ZeRO sharded the slices): the deferred optimizer states and generators."""
    from dscompile.runtime.zero_shard import shard_of

    if full.optimizer is not None:
        _load_full_optimizer(engine, sliced_state(full, engine.module, specs, groups), shard_of)
    if full.rng is not None:
        _restore_rng(full.rng)
