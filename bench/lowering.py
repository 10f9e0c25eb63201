"""Lowering benchmark: dscompile's Triton backend vs Inductor vs eager on a GPT and a Llama block.

Reports regions, kernels generated and kernels launched per training step, correctness against
eager, and (on a GPU only) milliseconds per step. On a CPU the Triton kernels run under
TRITON_INTERPRET=1, so times are not reported, only counts and correctness.

    python bench/lowering.py [--steps 20] [--seq-len 64]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import copy  # noqa: E402


def _step(model, batch):
    loss = model(*batch)
    loss.backward()
    return loss


def _time(model, batch, steps: int) -> float:
    for _ in range(3):
        _step(model, batch)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        _step(model, batch)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1000


def bench(name: str, seq_len: int, steps: int) -> dict:
    from dscompile.backends.triton import kernel_cache as kc
    from dscompile.zoo import build

    device = "cuda" if torch.cuda.is_available() else "cpu"
    overrides = {"seq_len": seq_len, "n_layers": 1}
    if device == "cpu":
        overrides["seq_len"] = min(seq_len, 16)
    case = build(name, seed=0, **overrides).to(device)
    batch = case.batch()
    row: dict = {"model": f"{name} block"}

    ref = copy.deepcopy(case.model)
    want = _step(ref, batch)

    torch._dynamo.reset()
    kc.LOWERED_GRAPHS.clear()
    model = copy.deepcopy(case.model)
    compiled = torch.compile(model, backend="dscompile", options={"lower": "triton"})
    got = _step(compiled, batch)
    graphs = dict(kc.LOWERED_GRAPHS)
    row["regions"] = sum(g["regions"] for g in graphs.values())
    row["kernels"] = sum(g["kernels"] for g in graphs.values())
    # matmul + epilogue template calls (GPU only): extra kernels beside the generated regions
    row["mm_templates"] = sum(g.get("matmul_templates", 0) for g in graphs.values())
    before = kc.STATS.launches
    model.zero_grad()
    _step(compiled, batch)
    row["launches/step"] = kc.STATS.launches - before
    grads_ok = all(
        torch.allclose(p.grad, q.grad, atol=1e-4, rtol=1e-3) for p, q in zip(model.parameters(), ref.parameters(), strict=True)
    )
    row["loss_ok"] = bool(torch.allclose(got, want, atol=1e-5, rtol=1e-5))
    row["grads_ok"] = grads_ok

    from torch._inductor import metrics

    torch._dynamo.reset()
    metrics.reset()
    ind_model = copy.deepcopy(case.model)
    ind = torch.compile(ind_model, backend="dscompile", options={"lower": "inductor"})
    _step(ind, batch)
    row["inductor_kernels"] = metrics.generated_kernel_count

    if device == "cuda":
        row["triton_ms"] = _time(compiled, batch, steps)
        row["inductor_ms"] = _time(ind, batch, steps)
        row["eager_ms"] = _time(copy.deepcopy(case.model), batch, steps)
        row["triton/inductor"] = row["triton_ms"] / row["inductor_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()
    rows = [bench(name, args.seq_len, args.steps) for name in ("gpt", "llama")]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(f"{r.get(k):.3f}" if isinstance(r.get(k), float) else str(r.get(k)) for k in keys))
    if not torch.cuda.is_available():
        print("(CPU: Triton kernels ran under TRITON_INTERPRET=1; times are reported on a GPU only)")


if __name__ == "__main__":
    main()
