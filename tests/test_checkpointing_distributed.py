"""Activation checkpointing on real gloo ranks: ``partition_activations`` and ZeRO-3 composition.

partition_activations: both ranks build the same model and batch (same seeds), so they compute
identical activations, as the ranks of a model-parallel group do. Each rank compares the
compiled step with an eager step of its own (loss and gradients, fp32, rel 1e-5 / abs 1e-6:
the graphs run the same ops, the gather only moves bytes), and reads the tensors autograd really
keeps between forward and backward (the compiled function's ``saved_tensors``, minus parameters
and inputs) with and without partitioning: they must shrink by about the group size. On four
ranks in two groups of two (inputs equal inside a group, different across groups) the gathers
must stay inside their group, and the ``debug`` check must refuse a group whose ranks differ.

ZeRO-3: the parameter all-gathers that ZeRO-3 marks for recomputation must survive the
checkpoint pass (gathered again in backward, not saved), and training must still match a
single-process reference.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dscompile.passes import checkpointing as ckpt
from dscompile.testing.distributed import requires_backend, run_distributed_or_fail
from dscompile.zoo import build

GPT = {"seq_len": 16, "d_model": 32, "n_heads": 2, "n_layers": 2, "vocab_size": 64, "dropout": 0.1}


def _saved_activation_bytes(loss: torch.Tensor, keep_alive: list[torch.Tensor]) -> int:
    """Bytes of the tensors the compiled function saved for backward, parameters and inputs excluded."""
    known = {t.untyped_storage().data_ptr() for t in keep_alive}
    total, stack, seen = 0, [loss.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if "CompiledFunction" in type(fn).__name__:
            total += sum(t.nbytes for t in fn.saved_tensors if t.untyped_storage().data_ptr() not in known)
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return total


def _step(model: torch.nn.Module, batch: tuple[torch.Tensor, ...], inputs: list[torch.Tensor]) -> dict[str, Any]:
    torch.manual_seed(7)  # the dropout masks: the same on every rank and in every run
    loss = model(*batch)
    saved = _saved_activation_bytes(loss, [*model.parameters(), *inputs])
    loss.backward()
    return {"loss": loss.detach(), "grads": [p.grad.clone() for p in model.parameters()], "saved": saved}


def partition_rank(rank: int, world: int, policies: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Eager, then each named ``activation_checkpointing`` section compiled; results and reports."""
    case = build("gpt", seed=0, **GPT)
    batch = case.batch()
    inputs = [t for t in batch if isinstance(t, torch.Tensor)]
    out: dict[str, Any] = {"eager": _step(copy.deepcopy(case.model), batch, inputs)}
    for name, section in policies.items():
        torch._dynamo.reset()
        ckpt.clear_reports()
        model = copy.deepcopy(case.model)
        compiled = torch.compile(model, backend="dscompile", options={"lower": "eager", "activation_checkpointing": section})
        out[name] = _step(compiled, batch, inputs)
        [out[name]["report"]] = ckpt.checkpoint_reports()
    return out


def _assert_matches_eager(result: dict[str, Any], eager: dict[str, Any]) -> None:
    torch.testing.assert_close(result["loss"], eager["loss"], rtol=1e-5, atol=1e-6)
    for got, want in zip(result["grads"], eager["grads"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.distributed
@requires_backend("gloo")
def test_partition_activations_on_two_ranks() -> None:
    shard = {"partition_activations": True, "partition_group_size": 2}
    policies = {"none": {"policy": "none"}, "none_sharded": {"policy": "none", **shard}, "full_sharded": {"policy": "full", **shard}}
    results = run_distributed_or_fail(partition_rank, 2, policies, timeout=300)
    for rank, result in enumerate(results):
        for name in policies:
            _assert_matches_eager(result[name], result["eager"])
        whole, sharded = result["none"], result["none_sharded"]
        report = sharded["report"]
        part = report["partition"]
        assert part["group_size"] == 2 and part["sharded"] > 0, part
        # every saved activation of this model is contiguous: all of them are sharded
        assert not part["kept_whole"], part["kept_whole"]
        # the model's figures: this rank keeps half of every sharded activation
        assert part["shard_bytes"] * 2 == pytest.approx(part["full_bytes"], rel=0.01)
        assert report["saved_bytes_unpartitioned"] == whole["report"]["saved_bytes"]
        # what autograd really holds between forward and backward: about half (the CPU generator
        # states that replay dropout, 5 KB each, are not activations and stay whole)
        rng = report["rng_state_bytes"]
        assert whole["saved"] > 0, rank
        assert sharded["saved"] - rng <= 0.51 * (whole["saved"] - rng), (sharded["saved"], whole["saved"], rng)
        assert sharded["saved"] == report["saved_bytes"]  # the report measures what runs
        full = result["full_sharded"]["report"]
        assert full["partition"]["sharded"] > 0 and full["saved_bytes"] < report["saved_bytes"]


def groups_rank(rank: int, world: int) -> dict[str, Any]:
    """Four ranks, two partition groups of two: inputs are the same inside a group and differ between
    groups, so a gather that reached outside its group would corrupt the gradients. Odd sizes make
    every saved activation need padding before it splits in two."""
    from dscompile.runtime.activation_partition import partition_group

    group = partition_group(2)
    torch.manual_seed(100 + rank // 2)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3), torch.nn.Sigmoid())
    x = torch.randn(9, 5)
    eager = copy.deepcopy(model)
    loss = eager(x).pow(2).sum()
    loss.backward()
    ckpt.clear_reports()
    section = {"policy": "none", "partition_activations": True, "partition_group_size": 2}
    # debug: the forward also checks that the group's copies agree (they do: same inputs inside a group)
    options = {"lower": "eager", "debug": True, "activation_checkpointing": section}
    compiled = torch.compile(model, backend="dscompile", options=options)
    c_loss = compiled(x).pow(2).sum()
    c_loss.backward()
    torch.testing.assert_close(c_loss, loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6)
    [report] = ckpt.checkpoint_reports()
    # one group of four ranks that are not replicas: the debug check must refuse, on every rank
    torch._dynamo.reset()
    wrong = torch.compile(copy.deepcopy(eager), backend="dscompile",
                          options={**options, "activation_checkpointing": {**section, "partition_group_size": 4}})
    try:
        wrong(x)
        refused = ""
    except RuntimeError as exc:
        refused = str(exc)
    return {"ranks": group.ranks, "index": group.index, "partition": report["partition"], "loss": float(loss), "refused": refused}


@pytest.mark.slow
@pytest.mark.distributed
@requires_backend("gloo")
def test_partition_groups_of_two_among_four_ranks() -> None:
    results = run_distributed_or_fail(groups_rank, 4, timeout=300)
    assert [r["ranks"] for r in results] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [r["index"] for r in results] == [0, 1, 0, 1]
    assert results[0]["loss"] == results[1]["loss"] != results[2]["loss"] == results[3]["loss"]
    for result in results:
        part = result["partition"]
        assert part["sharded"] >= 2 and not part["kept_whole"], part  # tanh and sigmoid outputs
        assert part["shard_bytes"] * 2 > part["full_bytes"]  # odd sizes: padded
        assert "not replicas" in result["refused"] and "[0, 1, 2, 3]" in result["refused"], result["refused"]


def test_partition_activations_needs_a_group_on_several_ranks() -> None:
    from dscompile.config import load_config
    from dscompile.errors import DSCompileConfigError
    from dscompile.pipeline import PassContext

    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    ctx = PassContext(config=load_config({}), graph_kind="joint", graph_name="g.joint", world_size=4, num_fwd_outputs=1)
    with pytest.raises(ckpt.PartitionGroupMissingError) as info:
        ckpt.checkpoint(gm, ctx, ckpt.CheckpointOptions(policy="full", partition_activations=True))
    message = str(info.value)
    assert info.value.key == "activation_checkpointing.partition_group_size"
    assert "identical activations" in message and "data-parallel" in message and "partition_activations to false" in message
    with pytest.raises(DSCompileConfigError, match="does not divide the world size 4"):
        ckpt.checkpoint(gm, ctx, ckpt.CheckpointOptions(policy="full", partition_activations=True, partition_group_size=3))
    with pytest.raises(DSCompileConfigError, match="partition_group_size"):
        load_config({"activation_checkpointing": {"partition_group_size": 2}})
    with pytest.raises(DSCompileConfigError, match="partition_group_size"):
        load_config({"activation_checkpointing": {"partition_activations": True, "partition_group_size": 0}})
    section = load_config({"activation_checkpointing": {"partition_activations": True, "partition_group_size": 2}}).sections
    assert section["activation_checkpointing"].partition_group_size == 2


# -- ZeRO-3 with checkpointing -------------------------------------------------------------------------------

ZERO_STEPS = 3


def zero3_rank(rank: int, world: int, dump: str) -> dict[str, Any]:
    import test_zero  # the ZeRO tests' model, batches and config

    import dscompile

    torch.manual_seed(0)
    case = test_zero._case("gpt")
    config = test_zero._config(3, 1, 0.0, {"stage3_max_reuse_distance": 0}, f"{dump}/rank{rank}")  # nothing kept gathered for backward
    config["activation_checkpointing"] = {"policy": "full"}
    engine, _, _, _ = dscompile.initialize(model=case.model, config=config)
    ckpt.clear_reports()
    losses = []
    for step in range(ZERO_STEPS):
        loss = engine(*test_zero._micro_batch(case, step, 0, rank))
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(float(total) / world)
    return {"losses": losses, "params": engine.full_parameters(), "reports": ckpt.checkpoint_reports()}


@pytest.mark.slow
@pytest.mark.distributed
@requires_backend("gloo")
def test_zero3_gathers_are_recomputed_under_checkpointing(tmp_path: Path) -> None:
    import test_zero

    results = run_distributed_or_fail(zero3_rank, 2, str(tmp_path), timeout=300)
    ref = test_zero.reference_run("gpt", 2, 1, 0.0, steps=ZERO_STEPS)
    test_zero._check_against_reference(results, ref)
    for result in results:
        [report] = result["reports"]
        assert report["policy"] == "full" and report["recompute_flops"] > 0
        # no gathered parameter is handed from forward to backward: ZeRO-3's recompute tags won
        assert not [name for name in report["saved"] if "zero_gather" in name], report["saved"]
        assert any("zero_gather" in name for name in report["recomputed"]), report["recomputed"]
    counts = test_zero._collective_counts(str(tmp_path / "rank0"))
    gather = "_c10d_functional.all_gather_into_tensor"
    # the parameters are gathered in forward and again in backward (bucketed into one collective each here)
    assert counts["forward"].get(gather, 0) > 0 and counts["backward"].get(gather, 0) == counts["forward"][gather], counts
    summary = json.loads(next((tmp_path / "rank0").glob("*.joint/checkpointing.json")).read_text())
    assert summary["policy"] == "full"
