"""Zoo models end to end with ``lower=triton`` (the interpreter on a CPU): outputs and gradients
equal eager, one kernel launch per lowered region, and the kernel cache is hit on a recompile."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import copy

import pytest

from dscompile.backends.triton import kernel_cache as kc
from dscompile.zoo import build

SMALL = {
    "mlp": {},
    "cnn": {},
    "gpt": {"seq_len": 8, "n_layers": 1},
    "gpt_explicit": {"seq_len": 8, "n_layers": 1},
    "llama": {"seq_len": 8, "n_layers": 1},
    "bert": {"seq_len": 8, "n_layers": 1},
}


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def run_compiled(case, options):
    torch._dynamo.reset()
    compiled = torch.compile(case.model, backend="dscompile", options=options)
    loss = compiled(*case.batch())
    loss.backward()
    return compiled, loss


def _assert_matches_eager(case, reference, loss):
    """Loss and every gradient of the compiled step equal eager's (fp32: loss 1e-5, gradients atol 1e-5 / rtol 1e-4)."""
    want = reference(*case.batch())
    want.backward()
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)
    for got, ref in zip(_grads(case.model), _grads(reference), strict=True):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_zoo_matches_eager(name):
    case = build(name, seed=0, **SMALL[name])
    reference = copy.deepcopy(case.model)
    kc.LOWERED_GRAPHS.clear()
    compiled, loss = run_compiled(case, {"lower": "triton"})
    _assert_matches_eager(case, reference, loss)

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


def test_matmul_epilogue_template_in_a_training_compile(monkeypatch):
    """With the template switched on (as on a GPU), addmm+relu chains become one template call."""
    from dscompile.kernels import matmul_epilogue

    monkeypatch.setattr(matmul_epilogue, "template_by_default", lambda: True)
    case = build("mlp", seed=0)
    reference = copy.deepcopy(case.model)
    kc.LOWERED_GRAPHS.clear()
    _, loss = run_compiled(case, {"lower": "triton"})
    _assert_matches_eager(case, reference, loss)
    forward = next(g for k, g in kc.LOWERED_GRAPHS.items() if k.endswith(".forward"))
    assert forward["matmul_templates"] >= 2


def test_dump_shows_regions_reasons_and_kernels(tmp_path):
    case = build("mlp", seed=0)
    run_compiled(case, {"lower": "triton", "dump": str(tmp_path)})
    forward = tmp_path / "graph_0.forward"
    report = (forward / "regions.txt").read_text()
    assert "region ds_region_0 [kernel ds_pointwise_" in report
    assert "skipped addmm: aten.addmm: matmul/convolution stays a library call" in report
    kernels = sorted((forward / "kernels").glob("ds_*.py"))
    assert kernels and "@triton.jit" in kernels[0].read_text()
    after_fuse = next(forward.glob("*_fuse")) / "nodes.txt"
    assert "fusion_skip_reason" in after_fuse.read_text() and '"region": "ds_region_0"' in after_fuse.read_text()
    page = (tmp_path / "graph_0.html").read_text()
    assert "fusion_skip_reason" in page and "ds_region_0" in page


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is only needed without a GPU")
def test_triton_lowering_without_interpreter_says_how_to_fix():
    import subprocess
    import sys

    code = (
        "import torch, triton.language\n"
        "m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))\n"
        "try:\n"
        "    torch.compile(m, backend='dscompile', options={'lower': 'triton'})(torch.randn(2, 4))\n"
        "except Exception as exc:\n"
        "    print('ERROR', exc)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert "ERROR" in result.stdout and "TRITON_INTERPRET=1" in result.stdout, result.stdout + result.stderr[-2000:]
