"""ZeRO checkpoints: one shard file per rank plus metadata, restore, re-partition and consolidation.

Layout of ``save_dir/tag/`` (DeepSpeed's file names):

- ``mp_rank_00_model_states.pt`` (rank 0): buffers and other non-parameter module state, the
  parameter layout (names, shapes, shard sizes), the world size, scheduler, counters.
- ``zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` (every rank): that rank's parameter shards,
  its optimizer state (over the shards) and its RNG state.

Loading on the same world size copies each rank's own file back (bit-exact continuation). On
another world size every rank rebuilds the full flat parameters and optimizer states from all
shard files and cuts its new shard. ``zero_to_fp32`` consolidates a checkpoint into a plain
full ``state_dict``; ``main(argv)`` is the ``dscompile zero-to-fp32 CKPT OUT`` command.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dscompile.errors import DSCompileError
from dscompile.runtime.devices import RngState, accelerator_devices, capture_rng, restore_rng

MODEL_STATES = "mp_rank_00_model_states.pt"
LATEST = "latest"


def shard_file(directory: Path, rank: int) -> Path:
    return directory / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def _optimizer_order(optimizer: torch.optim.Optimizer | None, shards: list[torch.Tensor]) -> list[int]:
    """Layout index of each parameter in the optimizer's own order (its state_dict numbering)."""
    if optimizer is None:
        return []
    index = {id(s): i for i, s in enumerate(shards)}
    return [index[id(p)] for group in optimizer.param_groups for p in group["params"]]


def save(engine: Any, directory: Path, client_state: dict | None) -> None:
    """Write this rank's shard file (and, on rank 0, the metadata file)."""
    zero = engine.zero
    directory.mkdir(parents=True, exist_ok=True)
    param_keys = {alias for layout in zero.layouts for alias in [layout.name, *layout.aliases]}
    if engine.rank == 0:
        module_state = {k: v for k, v in engine.module.state_dict().items() if k not in param_keys}
        meta = {
            "module": module_state,
            "zero": {"stage": zero.stage, "world_size": zero.world, "layouts": [layout.to_dict() for layout in zero.layouts]},
            **engine.core_state_dict(client_state),  # scheduler, counters, extensions (loss scaler), config
            "world_size": zero.world,
        }
        torch.save(meta, directory / MODEL_STATES)
    torch.save(
        {
            "rank": zero.rank,
            "world_size": zero.world,
            "shards": [s.detach().clone() for s in zero.shards],
            "optimizer": engine.optimizer.state_dict() if engine.optimizer is not None else None,
            "optimizer_order": _optimizer_order(engine.optimizer, zero.shards),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                    "devices": capture_rng(accelerator_devices(zero.shards)).to_dict()},
        },
        shard_file(directory, zero.rank),
    )


def _load_meta(directory: Path) -> dict[str, Any]:
    path = directory / MODEL_STATES
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: not a dscompile/DeepSpeed checkpoint directory")
    meta = torch.load(path, map_location="cpu", weights_only=False)
    if "zero" not in meta:
        raise DSCompileError(f"{directory} was saved without ZeRO; load it with zero_optimization.stage 0")
    return meta


def _load_shard_files(directory: Path, world: int) -> list[dict[str, Any]]:
    files = []
    for rank in range(world):
        path = shard_file(directory, rank)
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: the checkpoint was saved by {world} ranks and needs every shard file")
        files.append(torch.load(path, map_location="cpu", weights_only=False))
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
    return states, first["param_groups"]


def load(engine: Any, directory: Path, load_optimizer_states: bool, load_lr_scheduler_states: bool, load_module_only: bool) -> dict:
    """Restore shards (re-partitioning when the world size changed), optimizer, scheduler, counters."""
    from dscompile.runtime.zero_shard import shard_of

    zero = engine.zero
    meta = _load_meta(directory)
    saved_world = meta["zero"]["world_size"]
    saved_names = [layout["name"] for layout in meta["zero"]["layouts"]]
    if saved_names != [layout.name for layout in zero.layouts]:
        raise DSCompileError(f"checkpoint {directory} holds parameters {saved_names[:4]}..., the model has {[x.name for x in zero.layouts][:4]}...")
    engine.module.load_state_dict(meta["module"], strict=False)
    same_world = saved_world == zero.world
    own = None
    with torch.no_grad():
        if same_world:
            own = torch.load(shard_file(directory, zero.rank), map_location="cpu", weights_only=False)
            for shard, saved in zip(zero.shards, own["shards"], strict=True):
                shard.copy_(saved)
        else:
            files = _load_shard_files(directory, saved_world)
            full = full_parameters(meta, files)
            for layout, shard in zip(zero.layouts, zero.shards, strict=True):
                shard.copy_(shard_of(full[layout.name], zero.rank, zero.world))
        zero.gather_full_params()
    if not load_module_only:
        if load_optimizer_states and engine.optimizer is not None:
            if same_world:
                engine.optimizer.load_state_dict(own["optimizer"])
            else:
                _load_resharded_optimizer(engine, meta, files)
        engine.load_core_state_dict(meta, load_lr_scheduler_states)
        rng_source = own if own is not None else None
        if rng_source is None and shard_file(directory, zero.rank).is_file():
            rng_source = torch.load(shard_file(directory, zero.rank), map_location="cpu", weights_only=False)
        if rng_source is not None:
            torch.set_rng_state(rng_source["rng"]["torch"])
            if "devices" in rng_source["rng"]:
                restore_rng(RngState.from_dict(rng_source["rng"]["devices"]))
            random.setstate(rng_source["rng"]["python"])
    return meta["client_state"]


def _load_resharded_optimizer(engine: Any, meta: dict[str, Any], files: list[dict[str, Any]]) -> None:
    from dscompile.runtime.zero_shard import shard_of

    zero = engine.zero
    states, saved_groups = full_optimizer_states(meta, files)
    order = _optimizer_order(engine.optimizer, zero.shards)
    new_state: dict[int, dict[str, Any]] = {}
    for position, i in enumerate(order):
        layout = zero.layouts[i]
        entries = {}
        for key, value in states.get(layout.name, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == layout.numel:
                entries[key] = shard_of(value, zero.rank, zero.world)
            else:
                entries[key] = value.clone() if isinstance(value, torch.Tensor) else value
        if entries:
            new_state[position] = entries
    current = engine.optimizer.state_dict()
    groups = []
    for saved, live in zip(saved_groups, current["param_groups"], strict=True):
        groups.append({**saved, "params": live["params"]})
    engine.optimizer.load_state_dict({"state": new_state, "param_groups": groups})


def resolve_tag(load_dir: Path, tag: str | None) -> str | None:
    if tag is not None:
        return str(tag)
    latest = load_dir / LATEST
    return latest.read_text().strip() if latest.is_file() else None


def zero_to_fp32(checkpoint_dir: str | Path, tag: str | None = None) -> dict[str, torch.Tensor]:
    """The full fp32 ``state_dict`` of a ZeRO checkpoint (every rank's shards joined, tied names kept).

    ``checkpoint_dir`` is either the save directory (``latest`` picks the tag) or a tag directory.
    """
    root = Path(checkpoint_dir)
    directory = root
    if not (root / MODEL_STATES).is_file():
        chosen = resolve_tag(root, tag)
        if chosen is None:
            raise FileNotFoundError(f"{root} has neither {MODEL_STATES} nor a 'latest' file; pass the tag directory or --tag")
        directory = root / chosen
    meta = _load_meta(directory)
    files = _load_shard_files(directory, meta["zero"]["world_size"])
    params = full_parameters(meta, files)
    state: dict[str, torch.Tensor] = dict(meta["module"])
    for layout in meta["zero"]["layouts"]:
        value = params[layout["name"]]
        value = value.float() if value.is_floating_point() else value
        for name in [layout["name"], *layout["aliases"]]:
            state[name] = value
    return state


def main(argv: Sequence[str] | None = None) -> int:
    """``dscompile zero-to-fp32 CKPT OUT [--tag TAG]``: write the consolidated fp32 state_dict to OUT."""
    parser = argparse.ArgumentParser(prog="dscompile zero-to-fp32", description="Consolidate a ZeRO checkpoint into one fp32 state_dict file.")
    parser.add_argument("checkpoint", help="the save directory (with 'latest') or one tag directory")
    parser.add_argument("output", help="where to write the state_dict (torch.save)")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the one named in 'latest')")
    args = parser.parse_args(list(argv) if argv is not None else None)
    state = zero_to_fp32(args.checkpoint, args.tag)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, args.output)
    numel = sum(v.numel() for v in {id(v): v for v in state.values()}.values())
    print(f"wrote {len(state)} tensors ({numel:,} elements) to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
