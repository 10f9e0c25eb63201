"""Test-session set-up: Triton runs in its interpreter when there is no GPU, Dynamo starts clean."""

from __future__ import annotations

import os

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        # Must happen before anything imports triton.
        os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch, so cached graphs of one test never serve another."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def pytest_configure(config):
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA: skipped, with the reason, where there is none."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marked gpu); bench/gpu_check.py runs these on a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
