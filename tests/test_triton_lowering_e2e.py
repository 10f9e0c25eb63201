"""Zoo models end to end with ``lower=triton`` (the interpreter on a CPU): outputs and gradients
equal eager, one kernel launch per lowered region, and the kernel cache is hit on a recompile."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import copy

import pytest

from dscompile.backends import triton_kernels_cache as kc
from dscompile.zoo import build

SMALL = {"mlp": {}, "gpt": {"seq_len": 8, "n_layers": 1}, "llama": {"seq_len": 8, "n_layers": 1}}


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def run_compiled(case, options):
    torch._dynamo.reset()
    compiled = torch.compile(case.model, backend="dscompile", options=options)
    loss = compiled(*case.batch())
    loss.backward()
    return compiled, loss


@pytest.mark.parametrize("name", sorted(SMALL))
def test_zoo_matches_eager(name):
    case = build(name, seed=0, **SMALL[name])
    reference = copy.deepcopy(case.model)
    kc.LOWERED_GRAPHS.clear()
    compiled, loss = run_compiled(case, {"lower": "triton"})
    want = reference(*case.batch())
    want.backward()
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)
    for got, ref in zip(_grads(case.model), _grads(reference), strict=True):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)

    graphs = dict(kc.LOWERED_GRAPHS)
    assert any(k.endswith(".forward") for k in graphs) and any(k.endswith(".backward") for k in graphs)
    regions = sum(g["regions"] for g in graphs.values())
    kernels = sum(g["kernels"] for g in graphs.values())
    assert kernels >= 2 and kernels <= regions
    # A second step launches exactly one kernel per lowered region.
    case.model.zero_grad()
    before = kc.STATS.launches
    compiled(*case.batch()).backward()
    assert kc.STATS.launches - before == kernels


def test_second_compile_hits_the_cache():
    case = build("mlp", seed=0)
    run_compiled(case, {"lower": "triton"})
    misses, hits = kc.STATS.misses, kc.STATS.hits
    run_compiled(build("mlp", seed=0), {"lower": "triton"})
    assert kc.STATS.misses == misses
    assert kc.STATS.hits > hits


def test_pipeline_without_fuse_still_lowers_regions():
    case = build("mlp", seed=0)
    kc.LOWERED_GRAPHS.clear()
    run_compiled(case, {"pipeline": "cse,dce,lower(triton)"})
    assert sum(g["kernels"] for g in kc.LOWERED_GRAPHS.values()) >= 1
