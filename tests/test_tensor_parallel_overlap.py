"""``tensor_parallel.tp_overlap_comm`` (``passes/tensor_parallel/overlap.py``) on 2 gloo ranks.

With the flag on, every TP all-reduce of the backward graph (``tp_copy``'s: the gradient of a block's input)
must start before, and be waited for after, at least one weight-gradient matmul that does not need it, both in
the graph the pass returns and in the code Inductor (the default lowering) generates from it; before the pass
none is. Training (SGD, zoo Llama with GQA, TP=2) must equal the flag off and one process.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from dscompile.testing.distributed import requires_backend, run_distributed_or_fail

CASE = {"seq_len": 8, "d_model": 16, "n_heads": 4, "n_kv_heads": 2, "n_layers": 1, "vocab_size": 40, "hidden_dim": 32}
STEPS = 3
SGD = {"type": "SGD", "params": {"lr": 0.1}}


def _overlapped_matmuls(gm: torch.fx.GraphModule) -> list[int]:
    """For each all-reduce of the graph: how many weight-gradient matmuls (``mm`` whose result the graph returns)
    run between its start and its wait (so they cannot depend on it)."""
    from dscompile.passes.tensor_parallel.overlap import is_all_reduce_start

    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    counts = []
    for start in (n for n in nodes if is_all_reduce_start(n)):
        wait = next(iter(start.users))
        between = nodes[index[start] + 1 : index[wait]]
        counts.append(sum(1 for n in between if n.target is torch.ops.aten.mm.default and any(u.op == "output" for u in n.users)))
    return counts


def _inductor_overlap(code: str) -> list[int]:
    """The same count in Inductor's generated code: ``extern_kernels.mm`` calls between each in-place
    ``all_reduce_`` and the ``wait_tensor`` of the same buffer."""
    lines = code.splitlines()
    counts = []
    for i, line in enumerate(lines):
        started = re.search(r"_c10d_functional\.all_reduce_\.default\((.*), 'sum'", line)
        if started is None:
            continue
        buffer = started.group(1)
        end = next(j for j in range(i + 1, len(lines)) if f"wait_tensor.default({buffer})" in lines[j])
        counts.append(sum("extern_kernels.mm(" in lines[j] for j in range(i + 1, end)))
    return counts


def overlap_and_train(rank: int, world: int) -> dict[str, Any]:
    import dataclasses

    from torch._inductor.utils import run_and_get_code

    import dscompile
    from dscompile import pipeline
    from dscompile.zoo import build, make_batch

    info = pipeline.get_pass("tp_overlap")
    seen: dict[str, list[list[int]]] = {"before": [], "after": []}

    def recording(gm: torch.fx.GraphModule, ctx: Any, options: Any) -> torch.fx.GraphModule:
        if ctx.graph_kind == "backward":
            seen["before"].append(_overlapped_matmuls(gm))
        out = info.fn(gm, ctx, options) or gm
        if ctx.graph_kind == "backward":
            seen["after"].append(_overlapped_matmuls(out))
        return out

    pipeline._REGISTRY["tp_overlap"] = dataclasses.replace(info, fn=recording)
    reference = build("llama", seed=3, **CASE).model
    ref_opt = torch.optim.SGD(reference.parameters(), lr=SGD["params"]["lr"])
    runs: dict[bool, dict[str, Any]] = {}
    codes: list[str] = []
    for overlap in (True, False):
        case = build("llama", seed=3, **CASE)
        cfg = {"optimizer": SGD, "tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": overlap}}  # default lowering: Inductor
        engine, *_ = dscompile.initialize(model=case.model, config=cfg)
        losses = []
        for step in range(STEPS):
            batch = make_batch(case, seed=step)

            def train_step(engine: Any = engine, batch: tuple = batch) -> float:
                loss = engine(*batch)
                engine.backward(loss)
                engine.step()
                return float(loss.detach())

            if overlap and step == 0:
                with torch._inductor.config.patch(fx_graph_cache=False):  # generate the code, not a cache hit
                    loss, codes = run_and_get_code(train_step)
            else:
                loss = train_step()
            losses.append(loss)
        runs[overlap] = {"losses": losses, "params": engine.full_parameters()}
    ref_losses = []
    for step in range(STEPS):
        loss = reference(*make_batch(case, seed=step))
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(float(loss.detach()))
    ref_params = dict(reference.named_parameters())

    def max_err(params: dict[str, torch.Tensor], against: dict[str, torch.Tensor]) -> float:
        return max(float((params[n] - against[n].detach()).abs().max()) for n in against)

    backward_code = [c for c in codes if "tangents_1" in c]
    return {
        "seen": seen,
        "inductor": [_inductor_overlap(c) for c in backward_code],
        "losses": runs[True]["losses"],
        "losses_off": runs[False]["losses"],
        "ref_losses": ref_losses,
        "on_vs_off": max_err(runs[True]["params"], runs[False]["params"]),
        "on_vs_one_process": max_err(runs[True]["params"], ref_params),
    }


@pytest.mark.distributed
@requires_backend("gloo")
def test_tp_overlap_comm_overlaps_weight_gradients_and_trains_the_same() -> None:
    for r in run_distributed_or_fail(overlap_and_train, 2, timeout=300):
        # only the run with the flag on has the pass; its backward graph: 2 all-reduces (attention's and the MLP's tp_copy)
        assert len(r["seen"]["after"]) == 1, r["seen"]
        before, after = r["seen"]["before"][0], r["seen"]["after"][0]
        assert len(after) == 2 * CASE["n_layers"], after
        assert before == [0] * len(after), before  # as traced, each all-reduce is waited for at once
        assert min(after) >= 1, after  # after the pass a weight-gradient matmul runs under each
        # Inductor keeps that order (the pass turns off its reordering for peak memory for this graph)
        assert len(r["inductor"]) == 1 and len(r["inductor"][0]) == len(after) and min(r["inductor"][0]) >= 1, r["inductor"]
        # docs/tensor-parallelism.md: bit-identical to the flag off (only the order of independent nodes changes)
        # and within 1e-8 of one process
        assert r["losses"] == r["losses_off"] and r["on_vs_off"] == 0.0, (r["losses"], r["losses_off"], r["on_vs_off"])
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-6, abs=1e-6)
        assert r["on_vs_one_process"] <= 1e-8, r["on_vs_one_process"]


def test_the_pass_is_in_the_split_graph_pipeline_only_with_the_flag() -> None:
    import dataclasses

    from dscompile.config import load_config
    from dscompile.passes.tensor_parallel import split_graph_sections
    from dscompile.pipeline import pipeline_from_config

    for flag in (True, False):
        config = load_config({"tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": flag}})
        split = dataclasses.replace(config, sections=split_graph_sections(config.sections))
        names = [inv.name for inv in pipeline_from_config(split)]
        assert ("tp_overlap" in names) == flag, names
        if flag:  # the split graph's config: nothing more to split, the frontend accepts it
            assert not split.sections["tensor_parallel"].enabled
        else:
            assert "tensor_parallel" not in split.sections
