"""Checkpoints written by DeepSpeed (ZeRO 0-3), read into dscompile so training continues.

The reader undoes DeepSpeed's partitioning into a ``zero_checkpoint.FullState`` (full fp32
parameters and full per-parameter optimizer states by name), which any dscompile engine restores
at its own ZeRO stage and world size. So the optimizer states carry over even when the stage or
the number of ranks differs, and DeepSpeed is not needed to read them.

Layout of ``SAVE_DIR/TAG/`` as DeepSpeed 0.19.8 writes it (observed from real runs: CPU, gloo,
2 ranks, torch AdamW; the constants are the keys of ``deepspeed.checkpoint.constants``):

- ZeRO-0: ``mp_rank_00_model_states.pt`` only: ``module`` (full ``state_dict``), ``optimizer``
  (the torch optimizer's ``state_dict`` over the model's trainable parameters, in order).
- ZeRO-1/2: ``mp_rank_00_model_states.pt`` (``module`` full in the training dtype, ``param_shapes``:
  one ordered ``{name: shape}`` per optimizer group, ``shared_params`` {tied name: source name},
  ``buffer_names``, ``frozen_param_shapes``/``frozen_param_fragments``) and per data-parallel rank
  ``zero_pp_rank_R_mp_rank_00_optim_states.pt`` with ``optimizer_state_dict``: ``zero_stage``,
  ``partition_count``, ``single_partition_of_fp32_groups`` (this rank's slice of each group's flat
  fp32 master weights), ``base_optimizer_state`` (the torch optimizer over those flat slices:
  ``exp_avg`` etc. laid out like them), ``param_alignment_paddings``, ``group_paddings``, loss
  scaler. A group's flat vector is its parameters back to back (each followed by its alignment
  padding), padded at the end to a multiple of 2 x ranks, and cut into equal rank slices.
- ZeRO-3: per rank ``zero_pp_rank_R_mp_rank_00_model_states.pt`` (buffers, empty parameters,
  ``param_shapes``) and ``zero_pp_rank_R_mp_rank_00_optim_states.pt`` with ``fp32_flat_groups`` and
  ``optimizer_state_dict`` (the torch optimizer over them). Every parameter is cut separately:
  rank R holds elements ``[R*L, (R+1)*L)`` of it, ``L = ceil(numel / ranks)``, zero-padded, and a
  rank's flat group is those slices back to back in ``param_shapes`` order.
- With bf16, ZeRO-1/2/3 name the optimizer files ``bf16_zero_pp_rank_R_...``; bf16 without ZeRO writes
  no such file: its ``optimizer`` is DeepSpeed's FP16_Optimizer state (``fp32_groups``: the fp32
  master copy of each parameter, ``optimizer_state_dict`` over them, ``cur_scale``), the module
  16-bit.
- ``latest`` names the tag; the model states file also holds ``lr_scheduler``
  (``{"last_batch_iteration": n}`` for DeepSpeed's schedules), ``global_steps``, ``skipped_steps``,
  ``ds_config``, ``ds_version`` and the client state's keys at top level.

The files pickle three DeepSpeed classes (``LossScaler``, ``ZeroStageEnum``, ``fragment_address``);
they are read as plain stand-ins, with ``weights_only`` loading, so DeepSpeed need not be installed.
Pipeline- or tensor-parallel DeepSpeed checkpoints are refused with a clear error.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dscompile.runtime.checkpoint_io import MANIFEST, CheckpointCorruptError, CheckpointError
from dscompile.runtime.zero_checkpoint import FullState, named_group

log = logging.getLogger("dscompile.deepspeed_checkpoint")

MODEL_STATES = "mp_rank_00_model_states.pt"
_OPTIM_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
_ZERO3_MODEL_FILE = "zero_pp_rank_{}_mp_rank_00_model_states.pt"
# Keys DeepSpeed itself writes at the top level of the model states file; the rest is client state.
_RESERVED = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params", "frozen_param_fragments",
    "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names", "skipped_steps", "global_steps",
    "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version", "checkpoint_parallel_dimensions",
    "autoep_layers", "autoep_folding",
}  # fmt: skip


class DeepSpeedObject:
    """Stands in for a class DeepSpeed pickled into its checkpoint (so DeepSpeed need not be importable).

    An enum keeps its constructor arguments (``args``); an object its attributes.
    """

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.__dict__.update(state if isinstance(state, dict) else {"state": state})

    def __int__(self) -> int:
        return int(self.args[0])

    def __repr__(self) -> str:
        return f"{type(self).__module__}.{type(self).__name__}({self.args or self.__dict__})"


_STANDINS: dict[str, type] = {}


def _standin(qualified: str) -> type:
    if qualified not in _STANDINS:
        module, _, name = qualified.rpartition(".")
        _STANDINS[qualified] = type(name, (DeepSpeedObject,), {"__module__": module, "__qualname__": name})
    return _STANDINS[qualified]


def load_file(path: Path) -> Any:
    """``torch.load`` of one DeepSpeed file on the CPU, DeepSpeed's classes read as stand-ins."""
    if not path.is_file():
        raise CheckpointCorruptError(f"DeepSpeed checkpoint file {path} is missing")
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        others = [g for g in unsafe if not g.startswith("deepspeed.")]
        standins = [_standin(g) for g in unsafe if g.startswith("deepspeed.")]
        if others:
            raise CheckpointError(
                f"{path} pickles objects other than tensors and DeepSpeed's own ({', '.join(others[:4])}), "
                "which dscompile does not unpickle; drop them from the client state"
            )
        with torch.serialization.safe_globals(standins):
            return torch.load(path, map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointCorruptError(f"DeepSpeed checkpoint file {path} cannot be read: {type(exc).__name__}: {exc}") from exc


def _model_states_path(directory: Path) -> Path | None:
    for name in (MODEL_STATES, _ZERO3_MODEL_FILE.format(0)):
        if (directory / name).is_file():
            return directory / name
    return None


def is_deepspeed_checkpoint(directory: Path) -> bool:
    """True when ``directory`` holds a checkpoint DeepSpeed wrote (its model states name ``ds_version``)."""
    if (directory / MANIFEST).is_file():
        return False  # dscompile's own
    path = _model_states_path(directory)
    if path is None:
        return False
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=False, pickle_module=_PeekPickle)
    except Exception:
        return False
    return isinstance(state, dict) and "ds_version" in state


class _PeekPickle:
    """A pickle module for a quick look at a file: unknown DeepSpeed classes become stand-ins."""

    import pickle as _pickle

    load = _pickle.load

    class Unpickler(_pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if module.startswith("deepspeed"):
                return _standin(f"{module}.{name}")
            return super().find_class(module, name)


def _zero_stage(optim_state: dict[str, Any]) -> int:
    stage = optim_state.get("zero_stage")
    return int(stage) if stage is not None else 0


def _optim_files(directory: Path) -> dict[int, Path]:
    found: dict[int, Path] = {}
    for path in directory.iterdir():
        match = _OPTIM_FILE.match(path.name)
        if match:
            found[int(match.group(2))] = path
    return found


def read_full_state(directory: str | Path, optimizer: bool = True) -> FullState:
    """Read a DeepSpeed checkpoint directory into a ``FullState`` (``optimizer=False``: weights only)."""
    directory = Path(directory)
    path = _model_states_path(directory)
    if path is None:
        raise CheckpointError(f"{directory} holds no {MODEL_STATES} (nor ZeRO-3's {_ZERO3_MODEL_FILE.format(0)}): not a DeepSpeed checkpoint")
    model = load_file(path)
    if not isinstance(model, dict) or "ds_version" not in model:
        raise CheckpointError(f"{path} was not written by DeepSpeed (no 'ds_version')")
    _refuse_model_parallel(directory, model)
    optim_paths = _optim_files(directory)
    if not optim_paths:
        return _read_stage0(directory, model, optimizer)
    world = len(optim_paths)
    missing = [r for r in range(world) if r not in optim_paths]
    first = load_file(optim_paths[min(optim_paths)])["optimizer_state_dict"]
    stage = _zero_stage(first)
    counts = first.get("partition_count")
    saved_world = max(counts) if isinstance(counts, list) else int(counts or world)
    missing = [r for r in range(saved_world) if r not in optim_paths]
    if missing:
        example = directory / optim_paths[min(optim_paths)].name.replace(f"rank_{min(optim_paths)}_", f"rank_{missing[0]}_")
        raise CheckpointCorruptError(f"DeepSpeed checkpoint {directory} was saved by {saved_world} ranks but {example} is missing")
    optim = [first] + [load_file(optim_paths[r])["optimizer_state_dict"] for r in range(1, saved_world)]
    if stage == 3:
        models = [model] + [load_file(directory / _ZERO3_MODEL_FILE.format(r)) for r in range(1, saved_world)]
        full = _read_stage3(model, models, optim, optimizer)
    else:
        full = _read_flat_groups(model, optim, optimizer)
    label = f"ZeRO-{stage}" if stage else "bf16 (no ZeRO)"
    full.source = f"DeepSpeed {model['ds_version']} {label} checkpoint saved by {saved_world} ranks ({directory})"
    _common(full, model, first)
    return full


def _refuse_model_parallel(directory: Path, model: dict[str, Any]) -> None:
    dims = model.get("checkpoint_parallel_dimensions") or {}
    mp = model.get("mp_world_size", 1) or 1
    if mp > 1 or dims.get("tp_degree", 1) > 1 or dims.get("pp_degree", 1) > 1 or any(directory.glob("layer_*-model_states.pt")):
        raise CheckpointError(
            f"{directory} is a DeepSpeed checkpoint with tensor or pipeline parallelism (mp_world_size {mp}, {dims}): "
            "dscompile reads data-parallel (ZeRO 0-3) checkpoints only; convert it with DeepSpeed's universal checkpoint first"
        )


def _common(full: FullState, model: dict[str, Any], optim0: dict[str, Any] | None) -> None:
    full.global_steps = int(model.get("global_steps") or 0)
    full.skipped_steps = int(model.get("skipped_steps") or 0)
    full.lr_scheduler = {"deepspeed": model.get("lr_scheduler")} if model.get("lr_scheduler") is not None else None
    full.client_state = {k: v for k, v in model.items() if k not in _RESERVED}
    scaler = (optim0 or {}).get("loss_scaler")
    if scaler is not None:
        full.loss_scaler = {"deepspeed": {k: v for k, v in vars(scaler).items() if k != "args"}}


def _trainable_shapes(model: dict[str, Any]) -> list[dict[str, torch.Size]]:
    shapes = model.get("param_shapes")
    if not shapes:
        raise CheckpointError("the DeepSpeed checkpoint has no 'param_shapes': written by a DeepSpeed older than dscompile reads")
    return [dict(group) for group in shapes]


def _extra_module_state(model: dict[str, Any], trainable: set[str]) -> dict[str, torch.Tensor]:
    """Buffers (and frozen parameters kept whole) from the model states' ``module``."""
    module = model.get("module") or {}
    return {name: t for name, t in module.items() if name not in trainable and isinstance(t, torch.Tensor) and t.numel() > 0}


def _per_group_tensor(states: dict[Any, Any], group: int) -> dict[str, Any]:
    entry = states.get(group, states.get(str(group), {}))
    return dict(entry)


def _read_flat_groups(model: dict[str, Any], optim: list[dict[str, Any]], want_optimizer: bool) -> FullState:
    """ZeRO-1/2 (and bf16 without ZeRO): each group one flat vector cut into equal rank slices."""
    shapes = _trainable_shapes(model)
    params: dict[str, torch.Tensor] = {}
    opt_states: dict[str, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    base = [o.get("base_optimizer_state") for o in optim]
    paddings = optim[0].get("param_alignment_paddings")
    for g, group_shapes in enumerate(shapes):
        flat = torch.cat([o["single_partition_of_fp32_groups"][g].reshape(-1) for o in optim])
        offsets = _flat_offsets(group_shapes, paddings[g] if paddings else None, flat.numel(), len(optim))
        for name, offset in offsets.items():
            numel = math.prod(group_shapes[name])
            params[name] = flat[offset : offset + numel].view(tuple(group_shapes[name])).clone()
        if not want_optimizer or base[0] is None:
            continue
        per_rank = [_per_group_tensor(b["state"], g) for b in base]
        merged = {}
        for key, value in per_rank[0].items():
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == optim[0]["single_partition_of_fp32_groups"][g].numel():
                merged[key] = torch.cat([r[key].reshape(-1) for r in per_rank])
            else:
                merged[key] = value
        for name, offset in offsets.items():
            numel = math.prod(group_shapes[name])
            opt_states[name] = {k: v[offset : offset + numel].clone() if isinstance(v, torch.Tensor) and v.dim() == 1 else v for k, v in merged.items()}
        groups.append(named_group(base[0]["param_groups"][g], list(group_shapes)))
    full = FullState(source="", params=params, module_extra=_extra_module_state(model, set(params)))
    _add_shared(full, model)
    if want_optimizer and base[0] is not None:
        full.optimizer, full.param_groups = opt_states, groups
    return full


def _flat_offsets(shapes: dict[str, Any], paddings: Sequence[int] | None, available: int, world: int) -> dict[str, int]:
    """Where each parameter starts in a group's consolidated flat vector (ZeRO-1/2 layout)."""
    offsets, offset = {}, 0
    for i, (name, shape) in enumerate(shapes.items()):
        offsets[name] = offset
        offset += math.prod(shape)
        if paddings is not None:
            offset += paddings[i]
    align = 2 * world
    if math.ceil(offset / align) * align != math.ceil(available / align) * align:
        raise CheckpointCorruptError(
            f"the DeepSpeed ZeRO flat group holds {available} elements but its parameters need {offset}: the shard files do not belong together"
        )
    return offsets


def _read_stage3(model: dict[str, Any], models: list[dict[str, Any]], optim: list[dict[str, Any]], want_optimizer: bool) -> FullState:
    """ZeRO-3: every parameter cut separately across the ranks, each rank's slices back to back."""
    world = len(optim)
    shapes = {name: shape for group in _trainable_shapes(model) for name, shape in group.items()}
    flats = [torch.cat([t.reshape(-1) for t in o["fp32_flat_groups"]]) for o in optim]
    needed = sum(math.ceil(math.prod(s) / world) for s in shapes.values())
    if any(f.numel() != needed for f in flats):
        raise CheckpointCorruptError(f"the DeepSpeed ZeRO-3 flat groups hold {[f.numel() for f in flats]} elements per rank, the parameters need {needed}")
    params: dict[str, torch.Tensor] = {}
    slices: dict[str, tuple[int, int]] = {}
    offset = 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        part = math.ceil(numel / world)
        slices[name] = (offset, part)
        params[name] = torch.cat([f[offset : offset + part] for f in flats])[:numel].view(tuple(shape)).clone()
        offset += part
    full = FullState(source="", params=params, module_extra=_extra_module_state(model, set(params)))
    _add_frozen_zero3(full, models, world)
    _add_shared(full, model)
    inner = [o.get("optimizer_state_dict") for o in optim]
    if want_optimizer and inner[0] is not None:
        sub_groups = len(optim[0]["fp32_flat_groups"])
        per_rank = []
        for o in inner:
            entries = [_per_group_tensor(o["state"], g) for g in range(sub_groups)]
            merged = {}
            for key, value in entries[0].items():
                if isinstance(value, torch.Tensor) and value.dim() == 1:
                    merged[key] = torch.cat([e[key].reshape(-1) for e in entries])
                else:
                    merged[key] = value
            per_rank.append(merged)
        states = {}
        for name, (start, part) in slices.items():
            numel = math.prod(shapes[name])
            entry = {}
            for key, value in per_rank[0].items():
                if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == needed:
                    entry[key] = torch.cat([r[key][start : start + part] for r in per_rank])[:numel].clone()
                else:
                    entry[key] = value
            states[name] = entry
        full.optimizer = states
        saved_groups = inner[0]["param_groups"]
        user_groups = _trainable_shapes(model)
        if len(saved_groups) == len(user_groups):
            full.param_groups = [named_group(sg, list(ug)) for sg, ug in zip(saved_groups, user_groups, strict=True)]
        else:
            full.notes.append(f"DeepSpeed split {len(user_groups)} optimizer group(s) into {len(saved_groups)} sub-groups: kept this engine's hyper-parameters")
    return full


def _add_frozen_zero3(full: FullState, models: list[dict[str, Any]], world: int) -> None:
    shapes = models[0].get("frozen_param_shapes") or {}
    for name, shape in shapes.items():
        pieces = [m["frozen_param_fragments"][name].reshape(-1) for m in models]
        full.params[name] = torch.cat(pieces)[: math.prod(shape)].view(tuple(shape)).clone()
        full.module_extra.pop(name, None)


def _add_shared(full: FullState, model: dict[str, Any]) -> None:
    for name, source in (model.get("shared_params") or {}).items():
        if source in full.params:
            full.params[name] = full.params[source]


def _read_stage0(directory: Path, model: dict[str, Any], want_optimizer: bool) -> FullState:
    """No ZeRO: the whole model in ``module``; the optimizer numbered over the trainable parameters in order."""
    module = dict(model.get("module") or {})
    buffers = set(model.get("buffer_names") or [])
    params = {k: v for k, v in module.items() if k not in buffers}
    full = FullState(
        source=f"DeepSpeed {model['ds_version']} checkpoint saved without ZeRO ({directory})",
        params=params,
        module_extra={k: v for k, v in module.items() if k in buffers},
    )
    saved = model.get("optimizer")
    if saved is not None and "optimizer_state_dict" in saved and ("fp32_groups" in saved or "fp32_groups_flat" in saved):
        saved = _master_weights(saved, full, directory)  # 16-bit training: fp32 master weights and the optimizer over them
    if want_optimizer and saved is not None:
        if "state" not in saved or "param_groups" not in saved:
            full.notes.append(f"the DeepSpeed optimizer state in {directory} ({sorted(saved)[:4]}...) is not a torch optimizer's: not loaded")
        else:
            full.optimizer, full.param_groups = _stage0_optimizer(saved, full.params, directory)
    _common(full, model, None)
    if model.get("optimizer") is not None and "cur_scale" in model["optimizer"]:
        fp16 = model["optimizer"]
        full.loss_scaler = {"deepspeed": {"cur_scale": fp16["cur_scale"], "dynamic": fp16.get("dynamic_loss_scale", False), "cur_iter": fp16.get("cur_iter", 0),
                                          "last_overflow_iter": fp16.get("last_overflow_iter", -1)}}  # fmt: skip
    return full


def _master_weights(saved: dict[str, Any], full: FullState, directory: Path) -> dict[str, Any]:
    """DeepSpeed's FP16_Optimizer (fp16/bf16 without ZeRO): put its fp32 master weights in place of the 16-bit ones."""
    first_name = {}
    for name, tensor in full.params.items():  # tied parameters share a storage: one master copy for all their names
        first_name.setdefault(_storage_key(tensor), name)
    names = list(first_name.values())
    if "fp32_groups" in saved:
        masters = [t for group in saved["fp32_groups"] for t in group]
    else:
        flat = torch.cat([g.reshape(-1) for g in saved["fp32_groups_flat"]])
        sizes = [full.params[n].numel() for n in names]
        masters = [piece.view(full.params[n].shape) for n, piece in zip(names, flat[: sum(sizes)].split(sizes), strict=True)]
    if len(masters) != len(names) or any(m.shape != full.params[n].shape for m, n in zip(masters, names, strict=False)):
        raise CheckpointError(f"{directory}: DeepSpeed's fp32 master weights do not line up with the module's parameters in order")
    by_first = dict(zip(names, masters, strict=True))
    full.params = {name: by_first[first_name[_storage_key(t)]] for name, t in full.params.items()}
    return saved["optimizer_state_dict"]


def _storage_key(tensor: torch.Tensor) -> tuple:
    return tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape)


def _stage0_optimizer(saved: dict[str, Any], params: dict[str, torch.Tensor], directory: Path) -> tuple[dict, list]:
    """Map the optimizer's positions to parameter names: DeepSpeed numbers the parameters it was given, in order.

    DeepSpeed keeps no names here; the usual ``model.parameters()`` order is assumed and checked
    against every state tensor's shape (tied parameters appear once, under their first name).
    """
    unique: dict[tuple, str] = {}
    for name, tensor in params.items():  # tied parameters share a storage in the saved module
        unique.setdefault(_storage_key(tensor), name)
    names = list(unique.values())
    order = [i for group in saved["param_groups"] for i in group["params"]]
    if len(order) > len(names):
        raise CheckpointError(f"{directory}: the optimizer holds {len(order)} parameters, the saved module {len(names)}")
    by_index = dict(zip(order, names, strict=False))
    states = {}
    for index, entries in saved["state"].items():
        name = by_index[int(index)]
        for key, value in entries.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != params[name].shape:
                raise CheckpointError(
                    f"{directory}: optimizer state {key!r} of parameter #{index} has shape {tuple(value.shape)}, parameter {name} "
                    f"{tuple(params[name].shape)}: the optimizer was not built over model.parameters() in order"
                )
        states[name] = {k: v.reshape(-1) if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in entries.items()}
    groups = [named_group(g, [by_index[i] for i in g["params"]]) for g in saved["param_groups"]]
    return states, groups
