"""Block-sparsity layouts with DeepSpeed's class names and parameters, plus the config section.

A layout is a ``[num_heads, num_blocks, num_blocks]`` int64 tensor of 0/1: entry ``[h, i, j]``
says whether query block ``i`` of head ``h`` attends to key block ``j``. The rules follow the
published definitions (Sparse Transformers' fixed pattern, BigBird, Longformer, and DeepSpeed's
variable pattern), so a DeepSpeed user's ``sparse_attention`` section gives the same layouts.
Random blocks use a seeded generator so a compile is reproducible.
"""

from __future__ import annotations

import functools
import json
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from dscompile.errors import DSCompileConfigError
from dscompile.kernels.sparse_attention_op import register_layout_builder

log = logging.getLogger("dscompile.sparsity")

Attention = Literal["unidirectional", "bidirectional"]
_ATTENTION = ("unidirectional", "bidirectional")


def num_blocks_for(seq_len: int, block: int) -> int:
    """Number of blocks covering ``seq_len``; a partial last block is padded (and says so)."""
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    if seq_len % block:
        padded = -(-seq_len // block) * block
        log.warning(
            "sequence length %d is not a multiple of the sparse-attention block %d; padding to %d "
            "(the padded keys are masked out). Choose a block that divides the sequence length to avoid it.",
            seq_len,
            block,
            padded,
        )
    return -(-seq_len // block)


class SparsityConfig:
    """Base class: ``num_heads`` heads, square blocks of ``block`` tokens.

    With ``different_layout_per_head=False`` every head gets head 0's layout.
    """

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False) -> None:
        if num_heads <= 0:
            raise ValueError(f"num_heads must be positive, got {num_heads}")
        if block <= 0:
            raise ValueError(f"block must be positive, got {block}")
        self.num_heads = num_heads
        self.block = block
        self.different_layout_per_head = different_layout_per_head
        self.num_layout_heads = num_heads if different_layout_per_head else 1

    def setup_layout(self, seq_len: int) -> torch.Tensor:
        n = num_blocks_for(seq_len, self.block)
        return torch.zeros((self.num_heads, n, n), dtype=torch.int64)

    def check_and_propagate_first_head_layout(self, layout: torch.Tensor) -> torch.Tensor:
        if not self.different_layout_per_head:
            layout[1:] = layout[0]
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must define make_layout")

    def __repr__(self) -> str:
        items = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({items})"


class DenseSparsityConfig(SparsityConfig):
    """Every block attends to every block: ordinary dense attention."""

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        layout[:] = 1
        return layout


def _check_attention(attention: str) -> None:
    if attention not in _ATTENTION:
        raise ValueError(f"attention must be 'unidirectional' or 'bidirectional', got {attention!r}")


def _fill_window(layout: torch.Tensor, h: int, start: int, end: int, unidirectional: bool) -> None:
    """Blocks ``start..end-1`` all see each other (only earlier ones when unidirectional)."""
    window = torch.ones((end - start, end - start), dtype=layout.dtype)
    if unidirectional:
        window = torch.tril(window)
    layout[h, start:end, start:end] = window


class FixedSparsityConfig(SparsityConfig):
    """The "fixed" pattern of Sparse Transformers (Child et al., 2019).

    The sequence is cut into windows of ``num_local_blocks`` blocks that attend within
    themselves; the last ``num_global_blocks`` blocks of each window are global: every row
    (every later row when unidirectional) attends to them, and with
    ``horizontal_global_attention`` they attend to everything. With
    ``num_different_global_patterns > 1`` head ``h`` uses the ``h % patterns``-th group of
    blocks counted from the window's end as its global representative.
    """

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_local_blocks: int = 4,
        num_global_blocks: int = 1,
        attention: str = "bidirectional",
        horizontal_global_attention: bool = False,
        num_different_global_patterns: int = 1,
    ) -> None:
        super().__init__(num_heads, block, different_layout_per_head)
        if num_local_blocks <= 0 or num_global_blocks <= 0:
            raise ValueError("num_local_blocks and num_global_blocks must be positive")
        if num_local_blocks % num_global_blocks:
            raise ValueError(
                f"num_local_blocks ({num_local_blocks}) must be divisible by num_global_blocks ({num_global_blocks})"
            )
        _check_attention(attention)
        if attention != "bidirectional" and horizontal_global_attention:
            raise ValueError("horizontal_global_attention needs attention='bidirectional'")
        if num_different_global_patterns > 1 and not different_layout_per_head:
            raise ValueError("num_different_global_patterns > 1 needs different_layout_per_head=True")
        if num_different_global_patterns > num_local_blocks // num_global_blocks:
            raise ValueError(
                f"num_different_global_patterns ({num_different_global_patterns}) can be at most "
                f"num_local_blocks // num_global_blocks = {num_local_blocks // num_global_blocks}"
            )
        self.num_local_blocks = num_local_blocks
        self.num_global_blocks = num_global_blocks
        self.attention = attention
        self.horizontal_global_attention = horizontal_global_attention
        self.num_different_global_patterns = num_different_global_patterns

    def set_local_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        n = layout.shape[1]
        for start in range(0, n, self.num_local_blocks):
            _fill_window(layout, h, start, min(start + self.num_local_blocks, n), self.attention == "unidirectional")
        return layout

    def _set_global_columns(self, h: int, layout: torch.Tensor, start: int) -> None:
        end = start + self.num_global_blocks
        first_row = 0 if self.attention == "bidirectional" else start
        layout[h, first_row:, start:end] = 1
        if self.horizontal_global_attention:
            layout[h, start:end, :] = 1

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        n = layout.shape[1]
        local, glob = self.num_local_blocks, self.num_global_blocks
        offset = local - (1 + h % self.num_different_global_patterns) * glob
        full_end = n - n % local
        for window_start in range(0, full_end, local):
            self._set_global_columns(h, layout, window_start + offset)
        if full_end < n:  # a partial last window: its global group sits as far right as fits
            self._set_global_columns(h, layout, min(full_end + offset, n - glob))
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_local_layout(h, layout)
            self.set_global_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


def _check_global_ranges(starts: Sequence[int], ends: Sequence[int] | None) -> None:
    if ends is None:
        return
    if len(starts) != len(ends):
        raise ValueError(
            f"global_block_indices ({len(starts)}) and global_block_end_indices ({len(ends)}) must have the same length"
        )
    for s, e in zip(starts, ends, strict=True):
        if s >= e:
            raise ValueError(f"global block range [{s}, {e}) is empty: each start index must be below its end index")


def _global_ranges(starts: Sequence[int], ends: Sequence[int] | None, n: int) -> list[tuple[int, int]]:
    pairs = zip(starts, ends, strict=True) if ends is not None else ((s, s + 1) for s in starts)
    return [(s, min(e, n)) for s, e in pairs if s < n]


def _make_rng(seed: int | None) -> random.Random:
    return random.Random(seed)


class VariableSparsityConfig(SparsityConfig):
    """DeepSpeed's variable pattern: random blocks, variable-size local windows, global blocks.

    ``local_window_blocks`` lists the sizes of the first windows; the last size repeats to the
    end. Global blocks are given by index (``global_block_indices``) or as ranges
    (``..._end_indices``, exclusive); their columns are seen by every row (every later row
    when unidirectional), and with ``horizontal_global_attention`` their rows see everything.
    Each row gets ``num_random_blocks`` distinct random key blocks.
    """

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_random_blocks: int = 0,
        local_window_blocks: Sequence[int] | None = None,
        global_block_indices: Sequence[int] | None = None,
        global_block_end_indices: Sequence[int] | None = None,
        attention: str = "bidirectional",
        horizontal_global_attention: bool = False,
        seed: int | None = 0,
    ) -> None:
        super().__init__(num_heads, block, different_layout_per_head)
        _check_attention(attention)
        if attention != "bidirectional" and horizontal_global_attention:
            raise ValueError("horizontal_global_attention needs attention='bidirectional'")
        self.num_random_blocks = num_random_blocks
        self.local_window_blocks = list(local_window_blocks) if local_window_blocks is not None else [4]
        if not self.local_window_blocks or any(w <= 0 for w in self.local_window_blocks):
            raise ValueError(f"local_window_blocks must be positive sizes, got {self.local_window_blocks}")
        self.global_block_indices = list(global_block_indices) if global_block_indices is not None else [0]
        self.global_block_end_indices = list(global_block_end_indices) if global_block_end_indices is not None else None
        _check_global_ranges(self.global_block_indices, self.global_block_end_indices)
        self.attention = attention
        self.horizontal_global_attention = horizontal_global_attention
        self.seed = seed

    def set_random_layout(self, h: int, layout: torch.Tensor, rng: random.Random) -> torch.Tensor:
        n = layout.shape[1]
        if n < self.num_random_blocks:
            raise ValueError(f"num_random_blocks ({self.num_random_blocks}) exceeds the number of blocks ({n})")
        for row in range(n):
            layout[h, row, rng.sample(range(n), self.num_random_blocks)] = 1
        return layout

    def set_local_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        n = layout.shape[1]
        uni = self.attention == "unidirectional"
        start = 0
        for size in self.local_window_blocks:
            if start >= n:
                return layout
            _fill_window(layout, h, start, min(start + size, n), uni)
            start += size
        last = self.local_window_blocks[-1]
        for s in range(start, n, last):
            _fill_window(layout, h, s, min(s + last, n), uni)
        return layout

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        n = layout.shape[1]
        for start, end in _global_ranges(self.global_block_indices, self.global_block_end_indices, n):
            if self.horizontal_global_attention:
                layout[h, start:end, :] = 1
            first_row = 0 if self.attention == "bidirectional" else start
            layout[h, first_row:, start:end] = 1
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        rng = _make_rng(self.seed)
        for h in range(self.num_layout_heads):
            self.set_random_layout(h, layout, rng)
            self.set_local_layout(h, layout)
            self.set_global_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


def _set_sliding_window(layout: torch.Tensor, h: int, window_blocks: int) -> None:
    n = layout.shape[1]
    if n < window_blocks:
        raise ValueError(f"num_sliding_window_blocks ({window_blocks}) exceeds the number of blocks ({n})")
    half = window_blocks // 2
    for row in range(n):
        layout[h, row, max(0, row - half) : min(n, row + half + 1)] = 1


class BigBirdSparsityConfig(SparsityConfig):
    """BigBird (Zaheer et al., 2020): random + sliding window + global (ITC) blocks.

    Each row gets ``num_random_blocks`` distinct random key blocks (drawn among earlier blocks
    when unidirectional), a window of ``num_sliding_window_blocks`` centred on the diagonal,
    and the first ``num_global_blocks`` blocks are global rows and columns. Unidirectional
    keeps only the lower block triangle.
    """

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_random_blocks: int = 1,
        num_sliding_window_blocks: int = 3,
        num_global_blocks: int = 1,
        attention: str = "bidirectional",
        seed: int | None = 0,
    ) -> None:
        super().__init__(num_heads, block, different_layout_per_head)
        _check_attention(attention)
        self.num_random_blocks = num_random_blocks
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.num_global_blocks = num_global_blocks
        self.attention = attention
        self.seed = seed

    def set_random_layout(self, h: int, layout: torch.Tensor, rng: random.Random) -> torch.Tensor:
        n = layout.shape[1]
        if n < self.num_random_blocks:
            raise ValueError(f"num_random_blocks ({self.num_random_blocks}) exceeds the number of blocks ({n})")
        for row in range(n):
            pool = range(n) if self.attention == "bidirectional" else range(row + 1)
            layout[h, row, rng.sample(pool, min(self.num_random_blocks, len(pool)))] = 1
        return layout

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        _set_sliding_window(layout, h, self.num_sliding_window_blocks)
        return layout

    def set_global_layout_itc(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        n = layout.shape[1]
        if n < self.num_global_blocks:
            raise ValueError(f"num_global_blocks ({self.num_global_blocks}) exceeds the number of blocks ({n})")
        layout[h, : self.num_global_blocks, :] = 1
        layout[h, :, : self.num_global_blocks] = 1
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        rng = _make_rng(self.seed)
        for h in range(self.num_layout_heads):
            self.set_random_layout(h, layout, rng)
            self.set_sliding_window_layout(h, layout)
            self.set_global_layout_itc(h, layout)
        if self.attention == "unidirectional":
            layout = torch.tril(layout)
        return self.check_and_propagate_first_head_layout(layout)


class BSLongformerSparsityConfig(SparsityConfig):
    """Block-sparse Longformer (Beltagy et al., 2020): sliding window + global blocks.

    Global blocks (by index, or ranges with ``global_block_end_indices``) are both global rows
    and global columns. Unidirectional keeps only the lower block triangle.
    """

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_sliding_window_blocks: int = 3,
        global_block_indices: Sequence[int] | None = None,
        global_block_end_indices: Sequence[int] | None = None,
        attention: str = "bidirectional",
    ) -> None:
        super().__init__(num_heads, block, different_layout_per_head)
        _check_attention(attention)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.global_block_indices = list(global_block_indices) if global_block_indices is not None else [0]
        self.global_block_end_indices = list(global_block_end_indices) if global_block_end_indices is not None else None
        _check_global_ranges(self.global_block_indices, self.global_block_end_indices)
        self.attention = attention

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        _set_sliding_window(layout, h, self.num_sliding_window_blocks)
        return layout

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        n = layout.shape[1]
        for start, end in _global_ranges(self.global_block_indices, self.global_block_end_indices, n):
            layout[h, start:end, :] = 1
            layout[h, :, start:end] = 1
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_sliding_window_layout(h, layout)
            self.set_global_layout(h, layout)
        if self.attention == "unidirectional":
            layout = torch.tril(layout)
        return self.check_and_propagate_first_head_layout(layout)


class LocalSlidingWindowSparsityConfig(SparsityConfig):
    """Purely local attention: each row sees ``num_sliding_window_blocks // 2`` blocks on either
    side (bidirectional) or that many earlier blocks and itself (unidirectional, the default).

    DeepSpeed's class of the same name (not a ``sparse_attention`` config mode there either);
    like DeepSpeed's, every head shares one layout.
    """

    def __init__(self, num_heads: int, block: int = 16, num_sliding_window_blocks: int = 3, attention: str = "unidirectional") -> None:
        super().__init__(num_heads, block)
        _check_attention(attention)
        if num_sliding_window_blocks <= 0:
            raise ValueError(f"num_sliding_window_blocks must be positive, got {num_sliding_window_blocks}")
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.attention = attention

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        n = layout.shape[1]
        if n < self.num_sliding_window_blocks:
            raise ValueError(f"num_sliding_window_blocks ({self.num_sliding_window_blocks}) exceeds the number of blocks ({n})")
        half = self.num_sliding_window_blocks // 2
        for row in range(n):
            end = min(n, row + half + 1) if self.attention == "bidirectional" else row + 1
            layout[h, row, max(0, row - half) : end] = 1
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            self.set_sliding_window_layout(h, layout)
        return self.check_and_propagate_first_head_layout(layout)


def layout_to_mask(layout: torch.Tensor, block: int, seq_len: int | None = None) -> torch.Tensor:
    """Expand a block layout ``[H, nb, nb]`` to a boolean token mask ``[H, S, S]`` (True = attend)."""
    mask = layout.bool().repeat_interleave(block, dim=1).repeat_interleave(block, dim=2)
    if seq_len is not None:
        mask = mask[:, :seq_len, :seq_len]
    return mask


# ----------------------------------------------------------------------------- config section

Mode = Literal["dense", "fixed", "variable", "bigbird", "bslongformer"]
Kernel = Literal["auto", "triton", "flex", "reference"]

# Which keys each mode reads (beside mode, block, different_layout_per_head, seed, kernel).
_MODE_KEYS: dict[str, tuple[str, ...]] = {
    "dense": (),
    "fixed": (
        "num_local_blocks",
        "num_global_blocks",
        "attention",
        "horizontal_global_attention",
        "num_different_global_patterns",
    ),
    "variable": (
        "num_random_blocks",
        "local_window_blocks",
        "global_block_indices",
        "global_block_end_indices",
        "attention",
        "horizontal_global_attention",
    ),
    "bigbird": ("num_random_blocks", "num_sliding_window_blocks", "num_global_blocks", "attention"),
    "bslongformer": ("num_sliding_window_blocks", "global_block_indices", "global_block_end_indices", "attention"),
}


@dataclass
class SparseAttentionConfig:
    """The ``sparse_attention`` config section (DeepSpeed's keys, plus ``seed``, ``kernel`` and ``strict``).

    Keys left unset (None) take the DeepSpeed default of the chosen mode's class.
    """

    mode: Mode = "fixed"
    block: int = 16
    different_layout_per_head: bool = False
    num_local_blocks: int | None = None
    num_global_blocks: int | None = None
    attention: Attention | None = None
    horizontal_global_attention: bool | None = None
    num_different_global_patterns: int | None = None
    num_random_blocks: int | None = None
    local_window_blocks: list[int] | None = None
    global_block_indices: list[int] | None = None
    global_block_end_indices: list[int] | None = None
    num_sliding_window_blocks: int | None = None
    seed: int = 0
    kernel: Kernel = "auto"
    strict: bool = False  # dscompile's: an attention site left dense is an error, not a warning

    def mode_options(self) -> dict[str, Any]:
        """The mode-specific keyword arguments the user set."""
        return {k: getattr(self, k) for k in _MODE_KEYS[self.mode] if getattr(self, k) is not None}

    def sparsity_config(self, num_heads: int) -> SparsityConfig:
        """The DeepSpeed-style sparsity config object for ``num_heads`` heads."""
        cls = _MODE_CLASSES[self.mode]
        kwargs: dict[str, Any] = dict(block=self.block, different_layout_per_head=self.different_layout_per_head)
        kwargs.update(self.mode_options())
        if self.mode in ("variable", "bigbird"):
            kwargs["seed"] = self.seed
        return cls(num_heads, **kwargs)

    def validate(self, path: str = "sparse_attention") -> None:
        """Check values and that every mode-specific key that is set belongs to the chosen mode."""
        if self.block <= 0:
            raise DSCompileConfigError(f"{path}.block", f"must be positive, got {self.block}")
        for key in _OPTIONAL_KEYS:
            if getattr(self, key) is not None and key not in _MODE_KEYS[self.mode]:
                users = [m for m, keys in _MODE_KEYS.items() if key in keys]
                raise DSCompileConfigError(
                    f"{path}.{key}",
                    f"is not used by mode '{self.mode}'",
                    f"it belongs to mode {' / '.join(users)}; remove it or change the mode",
                )
        try:
            self.sparsity_config(num_heads=max(2, self.num_different_global_patterns or 1))
        except ValueError as exc:
            raise DSCompileConfigError(path, str(exc), "fix the sparse_attention values") from None


_OPTIONAL_KEYS = tuple(sorted({k for keys in _MODE_KEYS.values() for k in keys}))

_MODE_CLASSES: dict[str, type[SparsityConfig]] = {
    "dense": DenseSparsityConfig,
    "fixed": FixedSparsityConfig,
    "variable": VariableSparsityConfig,
    "bigbird": BigBirdSparsityConfig,
    "bslongformer": BSLongformerSparsityConfig,
}


def parse_sparse_attention(value: Any, path: str = "sparse_attention") -> SparseAttentionConfig:
    """Parse the ``sparse_attention`` section (a dict), checking keys, types and their mode."""
    from collections.abc import Mapping

    from dscompile.config import parse_dataclass

    if isinstance(value, SparseAttentionConfig):
        return value
    if not isinstance(value, Mapping):
        raise DSCompileConfigError(path, f"expected a JSON object, got {type(value).__name__}")
    return parse_dataclass(SparseAttentionConfig, dict(value), path)


@functools.lru_cache(maxsize=64)
def layout_from_spec(sparsity: str, num_heads: int, seq_len: int, device: str = "cpu") -> torch.Tensor:
    """The layout a JSON ``sparse_attention`` section gives for ``num_heads`` x ``seq_len`` (cached)."""
    config = parse_sparse_attention(json.loads(sparsity), "sparse_attention")
    with torch.inference_mode(False):  # a normal tensor even when first asked for under inference_mode: cacheable
        return config.sparsity_config(num_heads).make_layout(seq_len).to(device)


register_layout_builder(layout_from_spec)  # the op, called with a spec, builds its layout here
