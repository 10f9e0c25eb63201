"""ZeRO checkpoints: one shard file per rank plus metadata, restore, re-partition and consolidation.

Layout of ``save_dir/tag/`` (DeepSpeed's file names):

- ``mp_rank_00_model_states.pt`` (rank 0): buffers and other non-parameter module state, the
  parameter layout (names, shapes, shard sizes), the world size, scheduler, counters.
- ``zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` (every rank): that rank's parameter shards,
  its optimizer state (over the shards) and its RNG state.

Files are written through ``checkpoint_io.CheckpointWriter`` (staging directory, atomic files, a
manifest of sizes and checksums, ``latest`` last) and read through ``CheckpointReader``, which
verifies each file first. Loading on the same world size copies each rank's own file back
(bit-exact continuation). On another world size every rank rebuilds the full flat parameters
and optimizer states from all shard files and cuts its new shard (``FullState``, which every format's
reader produces). Telling the formats apart and reading any of them is ``checkpoint_formats.py``'s job.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dscompile.runtime.checkpoint_io import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointReader,
    CheckpointWriter,
)
from dscompile.runtime.devices import RngState, accelerator_devices, capture_rng, restore_rng
from dscompile.runtime.sixteen_bit import master_state_dict, saved_module_state

log = logging.getLogger("dscompile.zero_checkpoint")

MODEL_STATES = "mp_rank_00_model_states.pt"


def shard_name(rank: int, mp_rank: int = 0) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def model_states_name(mp_rank: int = 0) -> str:
    """The metadata file of one model-parallel (TP) rank's ZeRO group: ``mp_rank_XX_model_states.pt``."""
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def shard_file(directory: Path, rank: int) -> Path:
    return directory / shard_name(rank)


def _optimizer_order(optimizer: torch.optim.Optimizer | None, shards: list[torch.Tensor]) -> list[int]:
    """Layout index of each parameter in the optimizer's own order (its state_dict numbering)."""
    if optimizer is None:
        return []
    index = {id(s): i for i, s in enumerate(shards)}
    return [index[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _shard_values(zero: Any) -> list[torch.Tensor]:
    with zero.resident():  # offload_param: shards on the host or NVMe are read back for the file
        return [s.detach().clone() for s in zero.shards]


def save(engine: Any, ckpt: CheckpointWriter, client_state: dict | None, mp_rank: int = 0, extra: dict[str, Any] | None = None) -> None:
    """Write this rank's shard file (and, on the ZeRO group's first rank, the metadata file) into the checkpoint
    being saved. Under tensor parallelism each TP rank's ZeRO group writes its own set (``mp_rank``, DeepSpeed's
    names), with ``extra`` (the slicing) in its metadata."""
    zero = engine.zero
    param_keys = {alias for layout in zero.layouts for alias in [layout.name, *layout.aliases]}
    if zero.rank == 0:
        module_state = {k: v for k, v in master_state_dict(engine.module).items() if k not in param_keys}  # buffers, exact
        meta = {
            "module": module_state,
            "zero": {"stage": zero.stage, "world_size": zero.world, "layouts": [layout.to_dict() for layout in zero.layouts]},
            **engine.core_state_dict(client_state),  # scheduler, counters, extensions, config
            "loss_scaler": engine.loss_scaler.state_dict() if hasattr(engine.loss_scaler, "state_dict") else None,  # read by FullState
            "world_size": zero.world,
            **(extra or {}),
        }
        ckpt.save(meta, model_states_name(mp_rank))
    ckpt.save(
        {
            "rank": zero.rank,
            "world_size": zero.world,
            "shards": _shard_values(zero),
            "optimizer": engine.optimizer.state_dict() if engine.optimizer is not None else None,
            "optimizer_order": _optimizer_order(engine.optimizer, zero.shards),
            "rng": {
                "torch": torch.get_rng_state(),
                "python": random.getstate(),
                "devices": capture_rng(accelerator_devices(zero.shards)).to_dict(),  # dropout on a GPU draws from these
            },
        },
        shard_name(zero.rank, mp_rank),
    )


def load_meta(reader: CheckpointReader, mp_rank: int = 0) -> dict[str, Any]:
    meta = reader.load(model_states_name(mp_rank))
    if "zero" not in meta:
        raise CheckpointError(f"{reader.directory} was saved without ZeRO (zero_optimization.stage 0): it holds no ZeRO shards")
    return meta


def _load_shard_files(reader: CheckpointReader, world: int, mp_rank: int = 0) -> list[dict[str, Any]]:
    files = []
    for rank in range(world):
        name = shard_name(rank, mp_rank)
        if not reader.has(name):
            raise CheckpointCorruptError(f"{reader.directory / name} is missing: the checkpoint was saved by {world} ranks and needs every shard file")
        files.append(reader.load(name))
    return files


def _consolidate(pieces: Sequence[torch.Tensor], numel: int) -> torch.Tensor:
    return torch.cat([p.reshape(-1) for p in pieces])[:numel]


def full_parameters(meta: dict[str, Any], files: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Full parameter values by first name, from every rank's shards."""
    result = {}
    for i, layout in enumerate(meta["zero"]["layouts"]):
        flat = _consolidate([f["shards"][i] for f in files], layout["numel"])
        result[layout["name"]] = flat.view(layout["shape"]).clone()
    return result


def full_optimizer_states(meta: dict[str, Any], files: list[dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], list[dict]]:
    """Per parameter name: each optimizer state entry, sharded tensors consolidated to full flat ones."""
    layouts = meta["zero"]["layouts"]
    states: dict[str, dict[str, Any]] = {}
    first = files[0]["optimizer"]
    if first is None:
        return states, []
    for position, i in enumerate(files[0]["optimizer_order"]):
        layout = layouts[i]
        entries = {}
        per_rank = [f["optimizer"]["state"].get(position, {}) for f in files]
        for key, value in per_rank[0].items():
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == layout["shard_numel"]:
                entries[key] = _consolidate([r[key] for r in per_rank], layout["numel"])
            else:
                entries[key] = value
        states[layout["name"]] = entries
    order = files[0]["optimizer_order"]
    groups = [named_group(g, [layouts[order[i]]["name"] for i in g["params"]]) for g in first["param_groups"]]
    return states, groups


def named_group(group: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """An optimizer param group's hyper-parameters, its members by parameter name instead of position."""
    return {**{k: v for k, v in group.items() if k != "params"}, "param_names": names}


@dataclass
class FullState:
    """A checkpoint with its partitioning undone: full tensors by parameter name.

    Any engine (ZeRO at any stage and world size, or none) restores from it; dscompile's ZeRO
    checkpoints on another world size, its stage-0 checkpoints under ZeRO and DeepSpeed's
    checkpoints (``deepspeed_checkpoint``) all arrive here. ``optimizer`` holds per parameter the
    state entries, element-wise ones as flat full tensors; ``param_groups`` the hyper-parameters
    of each group with its ``param_names``.
    """

    source: str
    params: dict[str, torch.Tensor]
    module_extra: dict[str, torch.Tensor] = field(default_factory=dict)
    optimizer: dict[str, dict[str, Any]] | None = None
    param_groups: list[dict[str, Any]] | None = None
    lr_scheduler: dict | None = None
    loss_scaler: dict | None = None
    global_steps: int = 0
    micro_steps: int | None = None
    skipped_steps: int = 0
    client_state: dict = field(default_factory=dict)
    rng: dict | None = None
    notes: list[str] = field(default_factory=list)


def optimizer_param_names(engine: Any) -> list[str]:
    """The parameter name behind each position of the engine's optimizer (its state_dict numbering)."""
    if engine.optimizer is None:
        return []
    if engine.zero is not None:
        return [engine.zero.layouts[i].name for i in _optimizer_order(engine.optimizer, engine.zero.shards)]
    names: dict[int, str] = {}
    for name, p in engine.module.named_parameters():
        names.setdefault(id(p), name)
    return [names[id(p)] for group in engine.optimizer.param_groups for p in group["params"]]


def full_state_of_zero(reader: CheckpointReader, mp_rank: int = 0) -> FullState:
    """A dscompile ZeRO checkpoint's full state (of one TP rank's slices under tensor parallelism)."""
    meta = load_meta(reader, mp_rank)
    files = _load_shard_files(reader, meta["zero"]["world_size"], mp_rank)
    states, groups = full_optimizer_states(meta, files)
    params = full_parameters(meta, files)
    for layout in meta["zero"]["layouts"]:
        for alias in layout["aliases"]:
            params.setdefault(alias, params[layout["name"]])
    return FullState(
        source=f"dscompile ZeRO-{meta['zero']['stage']} checkpoint saved by {meta['zero']['world_size']} rank(s)",
        params=params,
        module_extra=dict(meta["module"]),
        optimizer=states if files[0]["optimizer"] is not None else None,
        param_groups=groups or None,
        lr_scheduler=meta["lr_scheduler"],
        loss_scaler=meta.get("loss_scaler"),
        global_steps=meta["global_steps"],
        micro_steps=meta["micro_steps"],
        skipped_steps=meta.get("skipped_steps", 0),
        client_state=meta["client_state"],
    )


def full_state_of_stage0(reader: CheckpointReader, engine: Any | None, name: str = MODEL_STATES) -> FullState:
    """A dscompile checkpoint without ZeRO (or one TP rank's file ``name``): the optimizer's positions are named
    by the saved ``optimizer_param_names``, or else by this engine's optimizer (the same script)."""
    state = reader.load(name)
    named = dict(saved_module_state(state))
    optimizer, groups = None, None
    saved_opt = state.get("optimizer")
    names = state.get("optimizer_param_names") or (optimizer_param_names(engine) if engine is not None else None)
    if saved_opt is not None and names is not None:
        order = [i for g in saved_opt["param_groups"] for i in g["params"]]
        if len(order) != len(names):
            raise CheckpointError(
                f"{reader.directory} (saved without ZeRO) has optimizer states for {len(order)} parameters, this engine's optimizer has {len(names)}"
            )
        by_index = dict(zip(order, names, strict=True))
        optimizer = {by_index[i]: dict(entries) for i, entries in saved_opt["state"].items()}
        groups = [named_group(g, [by_index[i] for i in g["params"]]) for g in saved_opt["param_groups"]]
    buffers = {n for n, _ in engine.module.named_buffers()} if engine is not None else set()  # the rest of the state_dict: parameters (tied names too)
    return FullState(
        source=f"dscompile checkpoint saved without ZeRO by {state.get('world_size', 1)} rank(s)",
        params={k: v for k, v in named.items() if k not in buffers},
        module_extra={k: v for k, v in named.items() if k in buffers},
        optimizer=optimizer,
        param_groups=groups,
        lr_scheduler=state.get("lr_scheduler"),
        loss_scaler=state.get("loss_scaler"),
        global_steps=state["global_steps"],
        micro_steps=state.get("micro_steps"),
        skipped_steps=state.get("skipped_steps", 0),
        client_state=state.get("client_state", {}),
        rng=state.get("rng"),
    )


def load(engine: Any, directory: Path, load_optimizer_states: bool, load_lr_scheduler_states: bool, load_module_only: bool) -> dict:
    """Restore a dscompile ZeRO checkpoint into a ZeRO engine: each rank's own file on the same world size
    (bit-exact continuation), through the full state otherwise."""
    zero = engine.zero
    reader = CheckpointReader(directory)
    meta = load_meta(reader)
    saved_world, saved_stage = meta["zero"]["world_size"], meta["zero"]["stage"]
    saved_names = [layout["name"] for layout in meta["zero"]["layouts"]]
    if saved_names != [layout.name for layout in zero.layouts]:
        raise CheckpointError(
            f"checkpoint {directory} (ZeRO-{saved_stage}, {saved_world} ranks) holds parameters {saved_names[:4]}..., "
            f"the model has {[x.name for x in zero.layouts][:4]}...: not a checkpoint of this model"
        )
    if saved_world != zero.world:
        restore_full_state(engine, full_state_of_zero(reader), load_optimizer_states, load_lr_scheduler_states, load_module_only)
        return meta["client_state"]
    engine.module.load_state_dict(meta["module"], strict=False)
    own = reader.load(shard_name(zero.rank))
    with torch.no_grad():
        for shard, saved in zip(zero.shards, own["shards"], strict=True):
            shard.copy_(saved)
        zero.gather_full_params()
    if not load_module_only:
        if load_optimizer_states and engine.optimizer is not None and own["optimizer"] is not None:
            engine.optimizer.load_state_dict(own["optimizer"])
        _restore_counters(engine, meta, load_lr_scheduler_states)
        _restore_rng(own["rng"])
    return meta["client_state"]


def _restore_counters(engine: Any, state: dict[str, Any] | FullState, load_lr_scheduler_states: bool) -> None:
    get = state.get if isinstance(state, dict) else lambda key, default=None: getattr(state, key, default)
    scheduler, scaler = get("lr_scheduler"), get("loss_scaler")
    if load_lr_scheduler_states and engine.lr_scheduler is not None and scheduler is not None:
        if "deepspeed" in scheduler:
            _load_deepspeed_scheduler(engine.lr_scheduler, scheduler["deepspeed"])
        else:
            engine.lr_scheduler.load_state_dict(scheduler)
    if scaler is not None and hasattr(engine.loss_scaler, "load_state_dict"):
        engine.loss_scaler.load_state_dict(_from_deepspeed_scaler(scaler["deepspeed"]) if "deepspeed" in scaler else scaler)
    engine.restore_counters(get("global_steps", 0), get("micro_steps"), get("skipped_steps", 0))
    saved = get("extensions") or {}
    for extension in getattr(engine, "extensions", []):  # the loss scaler is restored above, also from DeepSpeed's format
        if extension.name in saved and extension.name != "mixed_precision":
            extension.load_state_dict(saved[extension.name])


def _load_deepspeed_scheduler(scheduler: Any, saved: dict[str, Any]) -> None:
    """DeepSpeed's schedules save ``last_batch_iteration`` (-1 before the first step): the steps taken, less one.

    dscompile's own schedules keep DeepSpeed's state format and load it as it is; a torch LR
    scheduler passed by the user counts the steps taken in ``last_epoch``.
    """
    if "last_batch_iteration" in saved and hasattr(scheduler, "last_batch_iteration"):
        scheduler.load_state_dict(saved)
        return
    if "last_batch_iteration" not in saved or not hasattr(scheduler, "last_epoch"):
        log.warning("DeepSpeed scheduler state %s does not fit %s: the schedule restarts", sorted(saved), type(scheduler).__name__)
        return
    steps = int(saved["last_batch_iteration"]) + 1
    state = scheduler.state_dict()
    state.update(last_epoch=steps, _step_count=steps + 1)
    scheduler.load_state_dict(state)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]  # the optimizer's groups were restored


def _from_deepspeed_scaler(saved: dict[str, Any]) -> dict[str, Any]:
    """DeepSpeed's LossScaler / DynamicLossScaler attributes as dscompile's loss scaler state."""
    state = {"kind": "dynamic" if saved.get("dynamic") else "static", "cur_scale": float(saved.get("cur_scale", 1.0))}
    if saved.get("dynamic"):
        state.update(
            cur_iter=int(saved.get("cur_iter", 0)),
            last_overflow_iter=int(saved.get("last_overflow_iter", -1)),
            cur_hysteresis=int(saved.get("cur_hysteresis", saved.get("delayed_shift", 1))),
        )
    return state


def restore_full_state(engine: Any, full: FullState, load_optimizer_states: bool, load_lr_scheduler_states: bool, load_module_only: bool) -> None:
    """Set the engine's parameters, optimizer states, scheduler and counters from a ``FullState``."""
    from dscompile.runtime.zero_shard import shard_of

    model_names = [n for n, _ in engine.module.named_parameters()]
    missing = [n for n in model_names if n not in full.params]
    if missing:
        raise CheckpointError(f"the {full.source} has no value for parameter(s) {missing[:6]} of this model: not a checkpoint of this model")
    extra = {k: v for k, v in full.module_extra.items() if k not in full.params}
    with torch.no_grad():
        if engine.zero is not None:
            engine.zero.load_full_state(full.params)
        else:
            for name, p in engine.module.named_parameters():
                value = full.params[name]
                if tuple(value.shape) != tuple(p.shape):
                    raise CheckpointError(f"the {full.source} has parameter {name} of shape {tuple(value.shape)}, the model {tuple(p.shape)}")
                p.copy_(value.to(p.dtype))
    if extra:
        engine.module.load_state_dict(extra, strict=False)
    for note in full.notes:
        log.warning("%s", note)
    if load_module_only:
        return
    if load_optimizer_states and engine.optimizer is not None:
        if full.optimizer is None:
            log.warning("the %s holds no optimizer states: the optimizer starts fresh", full.source)
        else:
            _load_full_optimizer(engine, full, shard_of)
    _restore_counters(engine, full, load_lr_scheduler_states)
    if full.rng is not None:
        _restore_rng(full.rng)


def _restore_rng(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    if "devices" in rng:  # the accelerators' generators
        restore_rng(RngState.from_dict(rng["devices"]))
    random.setstate(rng["python"])


def _load_full_optimizer(engine: Any, full: FullState, shard_of: Any) -> None:
    """Cut the full per-parameter optimizer states into the engine's layout (shards or whole parameters)."""
    zero = engine.zero
    names = optimizer_param_names(engine)
    if zero is not None:
        layouts = {layout.name: layout for layout in zero.layouts}
    params = dict(engine.module.named_parameters())
    new_state: dict[int, dict[str, Any]] = {}
    for position, name in enumerate(names):
        numel = layouts[name].numel if zero is not None else params[name].numel()
        entries = {}
        for key, value in full.optimizer.get(name, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.numel() == numel:  # element-wise state
                flat = value.reshape(-1)
                entries[key] = shard_of(flat, zero.rank, zero.world) if zero is not None else flat.view(params[name].shape).clone()
            else:
                entries[key] = value.clone() if isinstance(value, torch.Tensor) else value
        if entries:
            new_state[position] = entries
    groups = [{k: v for k, v in g.items()} for g in engine.optimizer.state_dict()["param_groups"]]
    saved_groups = full.param_groups or []
    live_names, offset = [], 0
    for group in engine.optimizer.param_groups:
        live_names.append(names[offset : offset + len(group["params"])])
        offset += len(group["params"])
    same = len(saved_groups) == len(groups) and all(
        saved.get("param_names") is None or list(saved["param_names"]) == members for saved, members in zip(saved_groups, live_names, strict=False)
    )
    if same:
        for live, saved in zip(groups, saved_groups, strict=True):
            live.update({k: v for k, v in saved.items() if k in live and k != "params"})
    elif saved_groups:
        log.warning("the %s groups its parameters differently from this engine's optimizer: kept this engine's hyper-parameters", full.source)
    engine.optimizer.load_state_dict({"state": new_state, "param_groups": groups})
