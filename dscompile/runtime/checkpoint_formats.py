"""Which format a checkpoint directory holds, and reading any of them into one ``FullState``.

dscompile writes ZeRO shards (``zero_checkpoint``), whole models without ZeRO, tensor-parallel slices
(``tensor_parallel_checkpoint``) and pipeline stages; it also reads DeepSpeed's (``deepspeed_checkpoint``).
Each format's module reads its own files; this one, above them all, tells them apart, restores any of
them into an engine, and consolidates one into a plain fp32 ``state_dict`` (``dscompile zero-to-fp32``).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dscompile.runtime import deepspeed_checkpoint, tensor_parallel_checkpoint, zero_checkpoint
from dscompile.runtime.checkpoint_io import MANIFEST, CheckpointCorruptError, CheckpointError, CheckpointReader, atomic_save, read_latest
from dscompile.runtime.tensor_parallel import is_tensor_parallel_checkpoint
from dscompile.runtime.zero_checkpoint import (
    MODEL_STATES,
    FullState,
    full_state_of_stage0,
    full_state_of_zero,
    load,
    restore_full_state,
    shard_name,
)


def checkpoint_kind(directory: Path) -> str:
    """What wrote ``directory``: ``dscompile-zero``, ``dscompile-full`` (no ZeRO), ``dscompile-tp`` (tensor-parallel slices),
    ``deepspeed``, ``pipeline``.

    dscompile's own checkpoints carry ``manifest.json`` (``checkpoint_io``); DeepSpeed's do not.
    """
    if (directory / MANIFEST).is_file():
        reader = CheckpointReader(directory)
        if is_tensor_parallel_checkpoint(reader.names()):
            return "dscompile-tp"
        if reader.has(shard_name(0)):
            return "dscompile-zero"
        if reader.has(MODEL_STATES):
            return "dscompile-full"
        if any(name.startswith("pipe_stage_") for name in reader.names()):
            return "pipeline"
        raise CheckpointError(f"{directory} holds no model states file ({', '.join(reader.names()) or 'no files'})")
    if deepspeed_checkpoint.is_deepspeed_checkpoint(directory):
        return "deepspeed"
    if (directory / MODEL_STATES).is_file() or (directory / shard_name(0)).is_file():
        raise CheckpointCorruptError(
            f"{directory} has no {MANIFEST}: its save_checkpoint never finished (a crash or kill while saving), "
            "so it may be incomplete; load another tag"
        )
    present = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    raise CheckpointError(f"{directory} is not a dscompile or DeepSpeed checkpoint (it holds: {', '.join(present[:8]) or 'nothing'})")


def describe_checkpoint(directory: Path) -> str:
    """What a checkpoint is, for error messages: who wrote it, at which ZeRO stage, on how many ranks."""
    try:
        kind = checkpoint_kind(directory)
        if kind == "deepspeed":
            return "a " + deepspeed_checkpoint.read_full_state(directory, optimizer=False).source
        if kind == "dscompile-zero":
            zero = zero_checkpoint.load_meta(CheckpointReader(directory))["zero"]
            return f"a dscompile ZeRO-{zero['stage']} checkpoint saved by {zero['world_size']} rank(s)"
        if kind == "dscompile-full":
            state = CheckpointReader(directory).load(MODEL_STATES)
            return f"a dscompile checkpoint saved without ZeRO by {state.get('world_size', 1)} rank(s)"
        if kind == "dscompile-tp":
            meta = CheckpointReader(directory).load(MODEL_STATES)
            under = f" under ZeRO-{meta['zero']['stage']} over {meta['zero']['world_size']} rank(s)" if "zero" in meta else ""
            return f"a dscompile tensor-parallel checkpoint (TP={meta['tensor_parallel']['tp_size']} slices{under})"
        return "a PipelineEngine checkpoint"
    except CheckpointError as exc:
        return f"not a readable checkpoint ({exc})"


def read_full_state(directory: Path, engine: Any) -> FullState:
    """Any checkpoint dscompile reads, with its partitioning undone (ZeRO shards and TP slices joined)."""
    kind = checkpoint_kind(directory)
    if kind == "pipeline":
        raise CheckpointError(f"{directory} was saved by a PipelineEngine (pipe_stage_* files); load it with a 'pipeline' config")
    if kind == "deepspeed":
        return deepspeed_checkpoint.read_full_state(directory)
    if kind == "dscompile-tp":
        return tensor_parallel_checkpoint.full_state(CheckpointReader(directory), engine)
    if kind == "dscompile-zero":
        return full_state_of_zero(CheckpointReader(directory))
    return full_state_of_stage0(CheckpointReader(directory), engine)


def load_into(engine: Any, directory: Path, load_optimizer_states: bool, load_lr_scheduler_states: bool, load_module_only: bool) -> dict:
    """Restore any checkpoint dscompile reads into ``engine`` (ZeRO or not); returns the client state."""
    zero = getattr(engine, "zero", None)
    with zero.resident() if zero is not None else contextlib.nullcontext():  # offload_param: shards written back after
        return _load_into(engine, directory, load_optimizer_states, load_lr_scheduler_states, load_module_only)


def _load_into(engine: Any, directory: Path, load_optimizer_states: bool, load_lr_scheduler_states: bool, load_module_only: bool) -> dict:
    if engine.zero is not None and checkpoint_kind(directory) == "dscompile-zero":
        return load(engine, directory, load_optimizer_states, load_lr_scheduler_states, load_module_only)
    full = read_full_state(directory, engine)
    restore_full_state(engine, full, load_optimizer_states, load_lr_scheduler_states, load_module_only)
    return full.client_state


def zero_to_fp32(checkpoint_dir: str | Path, tag: str | None = None) -> dict[str, torch.Tensor]:
    """The full fp32 ``state_dict`` of a ZeRO checkpoint (every rank's shards joined, tied names kept).

    ``checkpoint_dir`` is the save directory (``latest`` or ``tag`` picks the checkpoint) or a tag
    directory. DeepSpeed's ZeRO checkpoints are read too.
    """
    root = Path(checkpoint_dir)
    if not root.exists():
        raise CheckpointError(f"{root} does not exist")
    if not root.is_dir():
        raise CheckpointError(f"{root} is a file; pass the checkpoint's directory")
    directory = root
    if not any((root / name).exists() for name in (MODEL_STATES, MANIFEST, shard_name(0), "zero_pp_rank_0_mp_rank_00_model_states.pt")):
        chosen = tag if tag is not None else read_latest(root)
        if chosen is None:
            raise CheckpointError(
                f"{root} is neither a checkpoint (no {MODEL_STATES}) nor a save directory with a 'latest' file; "
                "pass the tag directory or --tag"
            )
        directory = root / str(chosen)
        if not directory.is_dir():
            raise CheckpointError(f"checkpoint {directory} does not exist")
    kind = checkpoint_kind(directory)
    if kind == "deepspeed":
        full = deepspeed_checkpoint.read_full_state(directory, optimizer=False)
    elif kind == "dscompile-zero":
        full = full_state_of_zero(CheckpointReader(directory))
    elif kind == "dscompile-tp":
        full = tensor_parallel_checkpoint.full_state(CheckpointReader(directory), None)
    elif kind == "dscompile-full":
        raise CheckpointError(f"{directory} was saved without ZeRO: {MODEL_STATES} already holds the whole model under 'module'")
    else:
        raise CheckpointError(f"{directory} was saved by a PipelineEngine: its pipe_stage_*_model_states.pt files hold the weights by name")
    state: dict[str, torch.Tensor] = dict(full.module_extra)
    for name, value in full.params.items():
        state[name] = value.float() if value.is_floating_point() else value
    return state


def main(argv: Sequence[str] | None = None) -> int:
    """``dscompile zero-to-fp32 CKPT OUT [--tag TAG]``: write the consolidated fp32 state_dict to OUT."""
    parser = argparse.ArgumentParser(
        prog="dscompile zero-to-fp32", description="Consolidate a ZeRO checkpoint (dscompile's or DeepSpeed's) into one fp32 state_dict file."
    )
    parser.add_argument("checkpoint", help="the save directory (with 'latest') or one tag directory")
    parser.add_argument("output", help="where to write the state_dict (torch.save)")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the one named in 'latest')")
    args = parser.parse_args(list(argv) if argv is not None else None)
    state = zero_to_fp32(args.checkpoint, args.tag)
    out = Path(args.output)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_save(state, out)
    except OSError as exc:
        raise CheckpointError(f"cannot write {out}: {exc}") from None
    numel = sum(v.numel() for v in {id(v): v for v in state.values()}.values())
    print(f"wrote {len(state)} tensors ({numel:,} elements) to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
