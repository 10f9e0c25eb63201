"""The layout of NVMe offload's swap files: which pieces of which shards each tile holds, and where each segment lies.

A tile is one swap file holding every element-wise optimizer state of its pieces, after their fp32 masters where
those are kept in the files (slot 0); each segment is padded to ``swap.ALIGN`` so that O_DIRECT can read it in
place. Tiles cut a shard only at multiples of ``CUT_ELEMENTS`` from its start, so a fused kernel (torch's fused CPU
AdamW, which rounds by the position within a vector) steps every element as it would step the whole shard. Also
the whole-tile writes and reads outside the step (the masters at start, states for checkpoints); the streaming
step itself, with its buffers in flight, is ``nvme.py``'s.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dscompile.runtime.offload.host import Piece
from dscompile.runtime.offload.swap import SwapDirectory, align_up, aligned_buffer

CUT_ELEMENTS = 64
"""Tiles cut a shard only at multiples of this many elements from its start: wider than any CPU's vector of
fp32 (16 with AVX-512, 64 with 2048-bit SVE), so vectorized kernels see the same lanes as over the whole shard."""


@dataclass
class Tile:
    """One swap file: the masters of its pieces, then each state slot of each piece, every segment aligned."""

    name: str
    pieces: list[Piece]
    offsets: list[list[int]] = field(default_factory=list)  # offsets[slot][j], slot 0 = master
    master_bytes: int = 0
    nbytes: int = 0


def cut_tiles(shards: list[nn.Parameter], offloaded: list[int], group_of: dict[int, int], tile_elements: int) -> list[Tile]:
    """The offloaded shards, in order, cut into tiles of at most ``tile_elements`` elements (at least ``CUT_ELEMENTS``)
    at multiples of ``CUT_ELEMENTS`` within each shard; each piece's master is an empty placeholder."""
    tile_elements = max(CUT_ELEMENTS, int(tile_elements))
    tiles: list[Tile] = []
    current: list[Piece] = []
    filled = 0
    for i in offloaded:
        shard = shards[i]
        start = 0
        while start < shard.numel():
            room = tile_elements - filled
            stop = shard.numel() if shard.numel() - start <= room else start + room // CUT_ELEMENTS * CUT_ELEMENTS
            if stop == start:  # too little room left for an aligned cut: the piece starts the next tile
                tiles.append(Tile(f"tile_{len(tiles):05d}.swp", current))
                current, filled = [], 0
                continue
            current.append(Piece(i, start, stop, group_of[id(shard)], nn.Parameter(torch.empty(0, dtype=torch.float32))))
            filled += stop - start
            start = stop
            if filled >= tile_elements:
                tiles.append(Tile(f"tile_{len(tiles):05d}.swp", current))
                current, filled = [], 0
    if current:
        tiles.append(Tile(f"tile_{len(tiles):05d}.swp", current))
    return tiles


def first_state_slot(masters_in_files: bool) -> int:
    """Slot 0 of a tile holds the masters when they are in the files; the element-wise states follow."""
    return 1 if masters_in_files else 0


def lay_out(tile: Tile, slots: list[list[tuple[str, torch.dtype]]], masters_in_files: bool) -> None:
    """Set ``tile``'s segment offsets and sizes (``slots``: each param group's element-wise states)."""
    slot_count = first_state_slot(masters_in_files) + max((len(slots[p.group]) for p in tile.pieces), default=0)
    offset = 0
    tile.offsets = []
    for slot in range(slot_count):
        row = []
        for piece in tile.pieces:
            row.append(offset)
            offset += align_up(piece.numel * 4)
        tile.offsets.append(row)
        if slot == 0 and masters_in_files:
            tile.master_bytes = offset
    tile.nbytes = offset


def state_segments(piece: Piece, slots: list[list[tuple[str, torch.dtype]]], masters_in_files: bool) -> Iterator[tuple[int, str, torch.dtype]]:
    """(slot, state name, dtype) of each element-wise state of ``piece`` in its tile."""
    for k, (name, dtype) in enumerate(slots[piece.group], start=first_state_slot(masters_in_files)):
        yield k, name, dtype


def segment(buf: torch.Tensor, tile: Tile, slot: int, j: int, dtype: torch.dtype) -> torch.Tensor:
    """The view of ``buf`` (a tile's bytes) holding slot ``slot`` of the tile's ``j``-th piece, as ``dtype``."""
    start = tile.offsets[slot][j]
    numel = tile.pieces[j].numel
    return buf[start : start + numel * torch.empty((), dtype=dtype).element_size()].view(dtype)



# -- whole tiles written and read outside the step: at start and for checkpoints ---------------------------------
def write_masters(swap: SwapDirectory, tiles: list[Tile], shards: list[nn.Parameter], masters_in_files: bool, preallocate_states: bool) -> None:
    """Write each tile's masters now, and its zeroed state segments with ``preallocate_states`` (a full disk shows
    here, not mid-training); with neither, the file is written at the first step."""
    for tile in tiles:
        buf = aligned_buffer(tile.nbytes if preallocate_states else tile.master_bytes)
        if not buf.numel():
            continue  # fast_init and no masters in the files: each file is written at the first step
        buf.zero_()
        for j, piece in enumerate(tile.pieces):
            if masters_in_files:
                segment(buf, tile, 0, j, torch.float32).copy_(shards[piece.shard].detach().reshape(-1)[piece.start : piece.stop])
        swap.wait(swap.write(tile.name, buf))


def read_states(
    swap: SwapDirectory,
    tiles: list[Tile],
    slots: list[list[tuple[str, torch.dtype]]],
    masters_in_files: bool,
    shards: list[nn.Parameter],
    host_state: Mapping[nn.Parameter, dict[str, Any]],
) -> dict[int, dict[str, Any]]:
    """Every shard's states read back from its tiles as whole tensors, with the scalar ones the host optimizer keeps
    in memory (``host_state``, by piece master); shards with a piece whose states do not exist yet are left out."""
    parts: dict[int, dict[str, list[torch.Tensor]]] = {}
    scalars: dict[int, dict[str, Any]] = {}
    complete: dict[int, bool] = {}
    for tile in tiles:
        if not any(p.initialized for p in tile.pieces):
            for p in tile.pieces:
                complete[p.shard] = False
            continue
        buf = aligned_buffer(tile.nbytes)
        swap.wait(swap.read(tile.name, buf))
        for j, piece in enumerate(tile.pieces):
            complete[piece.shard] = complete.get(piece.shard, True) and piece.initialized
            if not piece.initialized:
                continue
            for k, name, dtype in state_segments(piece, slots, masters_in_files):
                parts.setdefault(piece.shard, {}).setdefault(name, []).append(segment(buf, tile, k, j, dtype).clone())
            state = host_state.get(piece.master, {})
            scalars.setdefault(piece.shard, {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()})
    out: dict[int, dict[str, Any]] = {}
    for i, ok in complete.items():
        if ok and i in parts:
            shape = shards[i].shape
            out[i] = {**scalars.get(i, {}), **{name: torch.cat(chunks).view(shape) for name, chunks in parts[i].items()}}
    return out


def write_states(
    swap: SwapDirectory,
    tiles: list[Tile],
    slots: list[list[tuple[str, torch.dtype]]],
    masters_in_files: bool,
    shards: list[nn.Parameter],
    host_state: MutableMapping[nn.Parameter, dict[str, Any]],
    states: dict[int, dict[str, Any]],
) -> None:
    """Rewrite every tile from a checkpoint's states (by shard index) and the shards' current values as masters; the
    scalar states go to ``host_state`` (the host optimizer's ``state``, a defaultdict), and each piece's
    ``initialized`` says whether its states now exist."""
    for tile in tiles:
        buf = aligned_buffer(tile.nbytes)
        buf.zero_()
        for j, piece in enumerate(tile.pieces):
            shard = shards[piece.shard]
            if masters_in_files:
                segment(buf, tile, 0, j, torch.float32).copy_(shard.detach().reshape(-1)[piece.start : piece.stop])
            entry = states.get(piece.shard)
            state = host_state[piece.master]
            state.clear()
            piece.initialized = bool(entry)
            if not entry:
                continue
            elementwise = dict(slots[piece.group])
            for k, name, dtype in state_segments(piece, slots, masters_in_files):
                segment(buf, tile, k, j, dtype).copy_(entry[name].reshape(-1)[piece.start : piece.stop])
            state.update({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in entry.items() if k not in elementwise})
        swap.wait(swap.write(tile.name, buf))


__all__ = ["CUT_ELEMENTS", "Tile", "cut_tiles", "first_state_slot", "lay_out", "read_states", "segment", "state_segments", "write_masters", "write_states"]
