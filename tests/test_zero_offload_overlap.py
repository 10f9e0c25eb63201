"""ZeRO-Offload's host step started from the backward graph (``offload_gradients`` pass, cpu offload, ZeRO-2/3).

Once a host-stepped shard's gradient is final in the backward graph (after its bucket's reduce-scatter wait),
``dscompile::offload_gradient`` hands it to the offloaded optimizer, which submits that shard's host step to a
worker thread while backward goes on; ``engine.step()`` waits for those steps and steps the rest. Training is
bitwise the same as without offload and as offload with the step at ``engine.step()``: losses and final
parameters, ZeRO-2 and ZeRO-3, gradient accumulation, ``lower: eager`` and the default Inductor lowering, real
gloo ranks. The counters say how many shard steps were handed off (and started) before backward returned; a
step started before the gradient is final (the accumulated micro-batches left out) is caught; clipping and
two forwards per backward fall back to the step at ``engine.step()``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
from test_zero import _case, _config, _micro_batch

import dscompile
from dscompile.runtime.offload import NvmeOffloadedOptimizer, OffloadedOptimizer
from dscompile.testing.distributed import requires_backend, run_distributed_or_fail

STEPS = 3
GAS = 2
NVME_TILE = 256  # elements (the test model holds ~4K): many tiles, several per shard for the big ones, several shards in the small ones


def _engine(
    stage: int, offload: bool | str, lower: str, clip: float = 0.0, gas: int = GAS, zero: dict | None = None, bf16: bool = False
) -> tuple[Any, Any]:
    """``offload``: False, True (cpu), or an NVMe directory (``offload_optimizer`` nvme in small tiles, and with
    ZeRO-3 ``offload_param`` nvme too: ZeRO-Infinity)."""
    torch.manual_seed(0)
    case = _case("gpt")
    extra = dict(zero or {})
    if isinstance(offload, str):
        extra["sub_group_size"] = NVME_TILE
        extra["offload_optimizer"] = {"device": "nvme", "nvme_path": offload, "buffer_count": 2}
        if stage == 3:
            extra["offload_param"] = {"device": "nvme", "nvme_path": offload}
    elif offload:
        extra["offload_optimizer"] = {"device": "cpu"}
    if stage == 3:  # every shard gathered again in backward, as offloaded parameters are: the same graphs in every run
        extra["stage3_max_reuse_distance"] = 0
    config = _config(stage, gas, clip, extra)
    config["lower"] = lower
    if bf16:
        config["bf16"] = {"enabled": True}
    engine, _, _, _ = dscompile.initialize(model=case.model, config=config)
    return engine, case


def _train(engine: Any, case: Any, rank: int, early: bool = True, gas: int = GAS, steps: int = STEPS) -> dict[str, Any]:
    ext = engine.extension("zero_offload")
    if ext is not None and not early:
        ext.optimizer.early_gate = lambda: False  # the same offload, every host step at engine.step()
    losses, handed = [], []
    for step in range(steps):
        for micro in range(gas):
            loss = engine(*_micro_batch(case, step, micro, rank))
            engine.backward(loss)
            if ext is not None:
                handed.append(ext.counters()["early_host_steps"]["submitted"])  # before step(): handed off during backward
            engine.step()
            losses.append(loss.item())
    out: dict[str, Any] = {"losses": losses, "params": engine.full_parameters(), "handed": handed}
    if ext is not None:
        opt = ext.optimizer
        out["counters"] = ext.counters()
        nvme = isinstance(opt, NvmeOffloadedOptimizer)
        out["host_shards"] = len(opt._tiles_of) if nvme else len(opt.pieces)
        out["tiles"] = len(opt.tiles) if nvme else 0
    param_ext = engine.extension("zero_offload_param")
    if param_ext is not None:
        out["param_counters"] = param_ext.counters()
    return out


def _bitwise(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["losses"] == b["losses"] and all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])


def _assert_bitwise(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    assert a["losses"] == b["losses"], f"{what}: losses differ {a['losses']} vs {b['losses']}"
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), f"{what}: parameter {name} differs"


def _expected_handed(shards: int, gas: int = GAS, steps: int = STEPS) -> list[int]:
    """Handed off only on the micro-step that ends a batch: every host-stepped shard once per batch."""
    return [shards * (step + (micro == gas - 1)) for step in range(steps) for micro in range(gas)]


# -- real gloo ranks: functional reduce-scatters, buckets, overlap -----------------------------------------------
NVME_CASES = {(2, "eager"), (3, "inductor")}  # NVMe tiles stepped in backward: ZeRO-2, and ZeRO-Infinity as users compile it


def overlap_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    # ZeRO-2 with several reduce-scatter buckets issued as their gradients exist; ZeRO-3's defaults overlap already
    zero = {2: {"reduce_bucket_size": 3000, "overlap_comm": True}, 3: {}}
    for stage in (2, 3):
        for lower in ("eager", "inductor"):
            variants: dict[str, bool | str] = {"none": False, "early": True}
            if (stage, lower) in NVME_CASES:
                variants["nvme"] = os.path.join(root, f"{stage}-{lower}")
                os.makedirs(variants["nvme"], exist_ok=True)
            for name, offload in variants.items():
                engine, case = _engine(stage, offload, lower, zero=zero[stage])
                results[f"{stage}/{lower}/{name}"] = _train(engine, case, rank)
                engine.destroy()
    return results


@pytest.mark.slow
@pytest.mark.distributed
@requires_backend("gloo")
def test_early_host_step_is_bitwise_equal_on_gloo_ranks(tmp_path: Any) -> None:
    results = run_distributed_or_fail(overlap_rank, 2, str(tmp_path), timeout=420)
    for rank, runs in enumerate(results):
        for stage in (2, 3):
            for lower in ("eager", "inductor"):
                key = f"{stage}/{lower}"
                early = runs[f"{key}/early"]
                _assert_bitwise(runs[f"{key}/none"], early, f"rank {rank} ZeRO-{stage} {lower}: early host step vs no offload")
                assert early["handed"] == _expected_handed(early["host_shards"]), (key, early["handed"])
                counters = early["counters"]["early_host_steps"]
                assert counters["submitted"] == STEPS * early["host_shards"]
                assert 0 <= counters["finished_in_backward"] <= counters["started_in_backward"] <= counters["submitted"]
                if (stage, lower) in NVME_CASES:
                    _check_nvme_early(runs[f"{key}/none"], runs[f"{key}/nvme"], f"rank {rank} ZeRO-{stage} {lower}: nvme tiles stepped in backward")


# -- one process (no process group: the ZeRO ops' eager path) ----------------------------------------------------
@pytest.mark.parametrize("stage", [2, 3])
def test_early_host_step_matches_and_starts_during_backward(stage: int) -> None:
    """Bitwise equal to no offload and to offload with the step at engine.step(), every host-stepped shard handed off during each batch-ending backward, and
    steps started before backward returned (the last shard's accumulate hook, after the graph, waits for the
    worker to pick one up, so the count does not depend on the machine's load)."""
    reference = _train(*_engine(stage, False, "eager"), 0)
    late = _train(*_engine(stage, True, "eager"), 0, early=False)  # the same offload, every host step at engine.step()
    _assert_bitwise(reference, late, f"ZeRO-{stage} offload without the early step vs no offload")
    assert late["handed"] == [0] * (STEPS * GAS)
    engine, case = _engine(stage, True, "eager")
    opt = engine.optimizer
    last = engine.zero.shards[0]  # its gradient comes last in backward (the embedding is used first)

    def wait_for_worker(_: torch.Tensor) -> None:
        if opt._early:
            deadline = time.monotonic() + 10
            while not opt._early_started and time.monotonic() < deadline:
                time.sleep(0.001)

    last.register_post_accumulate_grad_hook(wait_for_worker)
    run = _train(engine, case, 0)
    _assert_bitwise(reference, run, f"ZeRO-{stage} early host step vs no offload")
    assert run["handed"] == _expected_handed(run["host_shards"])
    counters = run["counters"]["early_host_steps"]
    assert counters["submitted"] == STEPS * run["host_shards"]
    assert STEPS <= counters["started_in_backward"] <= counters["submitted"]
    assert run["counters"]["early_host_step_seconds"] > 0


def test_a_step_before_the_gradient_is_final_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation check: a host step started from the last micro-batch's gradient alone (the accumulated ones left
    out, as if the hand-off came before the gradient is final) changes the training, and the comparison sees it."""
    reference = _train(*_engine(2, False, "eager"), 0)
    right = OffloadedOptimizer.hand_off

    def premature(self: OffloadedOptimizer, i: int, grad: torch.Tensor) -> None:
        shard = self.shards[i]
        kept, shard.grad = shard.grad, None
        try:
            right(self, i, grad)
        finally:
            shard.grad = kept

    monkeypatch.setattr(OffloadedOptimizer, "hand_off", premature)
    wrong = _train(*_engine(2, True, "eager"), 0)
    assert wrong["counters"]["early_host_steps"]["submitted"] == STEPS * wrong["host_shards"]
    assert not _bitwise(reference, wrong), "stepping before the gradient is final went unnoticed"


def test_fallbacks_step_at_engine_step() -> None:
    """Nothing is stepped early where a global decision comes between backward and the step: gradient clipping
    (the norm of every gradient), an overflow check (bf16's static loss scaler), or two forwards before one backward (a shard's graph gradient is then partial).
    Training stays bitwise equal to no offload."""
    clipped_ref = _train(*_engine(2, False, "eager", clip=0.05), 0)
    clipped = _train(*_engine(2, True, "eager", clip=0.05), 0)
    assert clipped["counters"]["early_host_steps"]["submitted"] == 0
    _assert_bitwise(clipped_ref, clipped, "clipping")
    bf16_ref = _train(*_engine(2, False, "eager", bf16=True), 0, steps=2)
    bf16 = _train(*_engine(2, True, "eager", bf16=True), 0, steps=2)
    assert bf16["counters"]["early_host_steps"]["submitted"] == 0  # its loss scaler skips a step on inf/NaN gradients
    _assert_bitwise(bf16_ref, bf16, "bf16")

    def twice(engine: Any, case: Any) -> dict[str, Any]:
        losses = []
        for step in range(2):
            first = engine(*_micro_batch(case, step, 0, 0))
            second = engine(*_micro_batch(case, step, 1, 0))
            engine.backward(first + second)
            engine.step()
            losses.append(first.item() + second.item())
        ext = engine.extension("zero_offload")
        return {"losses": losses, "params": engine.full_parameters(), "counters": ext.counters() if ext else None}

    plain = twice(*_engine(2, False, "eager", gas=1))
    offloaded = twice(*_engine(2, True, "eager", gas=1))
    assert offloaded["counters"]["early_host_steps"]["submitted"] == 0
    _assert_bitwise(plain, offloaded, "two forwards, one backward")


def test_graph_hands_off_after_the_last_read_of_an_in_place_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    """ZeRO-3 gathers each shard again in backward; on a CPU-only machine the shard is its own master, updated in
    place by the early step, so each hand-off must come after every node of the backward graph that reads its
    shard (and take those values as inputs, so no lowering reorders it before them)."""
    import dataclasses

    from dscompile import pipeline
    from dscompile.runtime.offload.gradient_sink import OFFLOAD_GRADIENT

    info = pipeline.get_pass("offload_gradients")
    seen: list[torch.fx.GraphModule] = []

    def spy(gm: Any, ctx: Any, options: Any) -> Any:
        out = info.fn(gm, ctx, options)
        if ctx.graph_kind == "backward":
            seen.append(out)
        return out

    monkeypatch.setitem(pipeline._REGISTRY, "offload_gradients", dataclasses.replace(info, fn=spy))
    engine, case = _engine(3, True, "eager", gas=1)
    _train(engine, case, 0, gas=1, steps=1)
    assert seen, "no backward graph went through the pass"
    graph = seen[0].graph
    order = {n: k for k, n in enumerate(graph.nodes)}
    hand_offs = [n for n in graph.nodes if n.target is OFFLOAD_GRADIENT]
    assert sorted(n.args[2] for n in hand_offs) == list(range(len(engine.zero.shards)))
    outputs = next(n for n in graph.nodes if n.op == "output").args[0]
    for node in hand_offs:
        grad, after, _ = node.args
        assert grad in outputs and all(order[x] < order[node] for x in [grad, *after])
    readers = 0
    for placeholder in (n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("primals_")):
        position = int(placeholder.name.split("_")[1]) - 1
        hand_off = next((n for n in hand_offs if outputs[position] is n.args[0]), None)
        if hand_off is None:
            continue
        for user in placeholder.users:  # a direct read of the shard (the eager re-gather here)
            assert user in hand_off.args[1], f"{user.name} reads {placeholder.name} but its hand-off does not wait for it"
            readers += 1
    assert readers > 0, "ZeRO-3 re-gathers in backward: some hand-off must wait for a read"


# -- NVMe: tiles stepped from the backward graph, their reads and writes overlapping the rest of backward ---------
def _check_nvme_early(reference: dict[str, Any], run: dict[str, Any], what: str, steps: int = STEPS) -> None:
    _assert_bitwise(reference, run, what)
    assert run["handed"] == _expected_handed(run["host_shards"], steps=steps), (what, run["handed"])
    counters = run["counters"]
    # every tile stepped during each batch-ending backward (none left for engine.step()); after the first one, the
    # tiles the forward reads ahead are the ones backward steps first
    assert counters["early_tiles"] == steps * run["tiles"] and run["tiles"] > 4, (what, counters)
    assert counters["early_host_steps"]["submitted"] == steps * run["host_shards"], (what, counters)
    if "param_counters" in run:  # ZeRO-Infinity: shards the step reads right after backward's gather of them are not read again
        assert run["param_counters"]["param_step_reuses"] > 0, (what, run["param_counters"])


@pytest.mark.parametrize("stage", [2, 3])
def test_nvme_tiles_step_during_backward_bitwise(stage: int, tmp_path: Any) -> None:
    """``offload_optimizer`` nvme (with ZeRO-3 also ``offload_param`` nvme): each tile is stepped in the backward
    as soon as every shard cut into it has its final gradient, bitwise as the step at ``engine.step()`` and as no
    offload; a tile stepped from a gradient that is not final yet (the accumulated micro-batch left out) is caught."""
    reference = _train(*_engine(stage, False, "eager"), 0)
    late_dir, early_dir = tmp_path / "late", tmp_path / "early"
    late_dir.mkdir()
    early_dir.mkdir()
    late = _train(*_engine(stage, str(late_dir), "eager"), 0, early=False)
    _assert_bitwise(reference, late, f"ZeRO-{stage} nvme offload, step at engine.step()")
    assert late["counters"]["early_tiles"] == 0
    _check_nvme_early(reference, _train(*_engine(stage, str(early_dir), "eager"), 0), f"ZeRO-{stage} nvme tiles stepped in backward")


def test_nvme_early_tile_with_partial_gradient_is_caught(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above fails if a tile steps on the micro-batch's own gradient without the accumulated ones."""
    right = NvmeOffloadedOptimizer._early_hand_off

    def forgetful(self: NvmeOffloadedOptimizer, i: int, grad: torch.Tensor) -> None:
        shard = self.shards[i]
        saved, shard.grad = shard.grad, None
        try:
            right(self, i, grad)
        finally:
            shard.grad = saved

    reference = _train(*_engine(3, False, "eager"), 0)
    monkeypatch.setattr(NvmeOffloadedOptimizer, "_early_hand_off", forgetful)
    run = _train(*_engine(3, str(tmp_path), "eager"), 0)
    assert not _bitwise(reference, run)
