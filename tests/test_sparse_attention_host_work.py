"""The Triton block-sparse attention's per-call host work: its kernels and nothing else.

On an H200 the op's time barely grew from 4k to 16k tokens (1.28 / 1.69 / 1.79 ms), the mark of a per-call cost.
A steady call (the layout seen before) must launch exactly its Triton kernels (forward; backward: the ``delta``
preprocess, dk/dv, dq), no ATen kernel around them (casts, products, sums, pads, zero gradients) and read
nothing back on the host: the layout's device copy and look-up tables come from ``kernels/layout_cache.py``.

The Triton kernels are replaced by launch counters here (their numerics are checked in the interpreter by
``tests/test_sparse_attention_op.py``), so the profiler sees only the launcher's own work.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dscompile.kernels import block_sparse_attention as launcher
from dscompile.kernels import layout_cache
from dscompile.kernels.sparse_attention_op import block_sparse_attention
from dscompile.sparsity import BigBirdSparsityConfig
from dscompile.testing.host_work import count_host_work

HEADS, SEQ, DIM, BLOCK = 2, 256, 16, 32
KERNELS = ("block_sparse_fwd_kernel", "block_sparse_bwd_preprocess_kernel", "block_sparse_bwd_dkdv_kernel", "block_sparse_bwd_dq_kernel")


class _CountedKernel:
    """Stands in for a ``triton.jit`` function: ``kernel[grid](...)`` counts the launch and computes nothing."""

    def __init__(self, name: str, launches: Counter[str]) -> None:
        self.name, self.launches = name, launches

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launches[self.name] += 1

        return launch


@pytest.fixture
def triton_launches(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    launches: Counter[str] = Counter()
    stub = SimpleNamespace(**{name: _CountedKernel(name, launches) for name in KERNELS})
    monkeypatch.setattr(launcher, "_kernels", lambda: stub)
    return launches


def _training_call(dtype: torch.dtype, seq: int = SEQ) -> Any:
    layout = BigBirdSparsityConfig(HEADS, BLOCK, num_random_blocks=1, num_sliding_window_blocks=3, num_global_blocks=1).make_layout(seq)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, seq, DIM, generator=g).to(dtype).requires_grad_() for _ in range(3))
    grad = torch.randn(1, HEADS, seq, DIM, generator=g).to(dtype)

    def call() -> None:
        out = block_sparse_attention(q, k, v, layout, None, None, BLOCK, DIM**-0.5, False, 0.0, "triton")[0]
        torch.autograd.grad(out, (q, k, v), grad)

    return call


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_steady_call_launches_only_its_kernels(triton_launches: Counter[str], dtype: torch.dtype) -> None:
    call = _training_call(dtype)
    call()  # the first call with this layout builds its tables
    triton_launches.clear()
    misses = layout_cache.stats["misses"]
    work = count_host_work(call)
    assert triton_launches == Counter(KERNELS), triton_launches  # one launch each: forward, delta, dk/dv, dq
    assert work.launches == Counter(), work.launches  # no cast, product, sum, pad or zero-gradient kernel around them
    assert work.syncs == 0
    assert layout_cache.stats["misses"] == misses  # the tables came from the cache


def test_the_counter_sees_a_rebuilt_layout_analysis(triton_launches: Counter[str]) -> None:
    """With the cache emptied the same call rebuilds the tables: launches and a host read appear, so the test above
    would fail if a call bypassed the cache."""
    call = _training_call(torch.bfloat16)
    call()
    layout_cache.clear()
    work = count_host_work(call)
    assert work.syncs >= 1 and work.launches, work
