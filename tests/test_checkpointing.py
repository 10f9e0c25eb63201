"""Activation checkpointing pass: numerics against eager, saved bytes against budgets, config, dump.

Dropout: the compiled step draws random numbers in the same order as eager on CPU, and the
partitioner replays recomputed dropouts from the forward's saved generator state, so compiled
results with any policy equal eager with the same seed (checked exactly below, masks included).
"""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch

from dscompile.config import load_config
from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError
from dscompile.passes import checkpointing as ckpt
from dscompile.pipeline import PassContext, parse_pipeline
from dscompile.zoo import build

POLICIES = [
    {"policy": "none"},
    {"policy": "full"},
    {"policy": "selective"},
    {"memory_budget": 1.0},
    {"memory_budget": 0.6},
    {"memory_budget": 0.2},
]
ZOO_CASES = {
    "gpt": {"dropout": 0.1},
    "gpt_explicit": {"dropout": 0.1},
    "llama": {},
    "bert": {},
    "mlp": {},
}


def _train_step(model: torch.nn.Module, batch: tuple[torch.Tensor, ...], seed: int = 7) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    torch.manual_seed(seed)
    loss = model(*batch)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], torch.get_rng_state()


def _compiled_step(case, ac: dict, **options):
    torch._dynamo.reset()
    ckpt.clear_reports()
    model = copy.deepcopy(case.model)
    compiled = torch.compile(model, backend="dscompile", options={"lower": "eager", "activation_checkpointing": ac, **options})
    loss, grads, rng = _train_step(compiled, case.batch())
    reports = ckpt.checkpoint_reports()
    assert len(reports) == 1, "one Dynamo graph expected for zoo models"
    return loss, grads, rng, reports[0]


def _eager_step(case):
    return _train_step(copy.deepcopy(case.model), case.batch())


def _assert_same(eager, compiled) -> None:
    loss, grads, rng = eager
    c_loss, c_grads, c_rng = compiled[:3]
    torch.testing.assert_close(c_loss, loss, rtol=1e-5, atol=1e-6)
    for g, cg in zip(grads, c_grads):
        torch.testing.assert_close(cg, g, rtol=1e-4, atol=1e-5)
    # the compiled step consumed the global generator exactly as eager did
    assert torch.equal(rng, c_rng)


@pytest.mark.parametrize("ac", POLICIES, ids=lambda ac: "-".join(f"{k}={v}" for k, v in ac.items()))
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_every_policy_matches_eager(name: str, ac: dict) -> None:
    case = build(name, **ZOO_CASES[name])
    _assert_same(_eager_step(case), _compiled_step(case, ac))


@pytest.mark.parametrize("ac", [{"policy": "full"}, {"policy": "selective"}, {"memory_budget": 0.4}], ids=["full", "selective", "budget0.4"])
@pytest.mark.parametrize("name", ["gpt_explicit", "bert", "mlp"])
def test_other_zoo_models_match_eager(name: str, ac: dict) -> None:
    case = build(name, **ZOO_CASES[name])
    _assert_same(_eager_step(case), _compiled_step(case, ac))


def test_dropout_is_replayed_not_redrawn() -> None:
    """With full recomputation every dropout runs again in backward; masks must repeat exactly."""
    case = build("gpt", dropout=0.5)
    eager = _eager_step(case)
    compiled = _compiled_step(case, {"policy": "full"})
    assert compiled[3]["rng_replays"] > 0 and compiled[3]["rng_state_bytes"] > 0
    _assert_same(eager, compiled)


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_saved_bytes_fall_with_the_budget_and_meet_it(name: str) -> None:
    case = build(name, **ZOO_CASES[name])
    measured = []
    for budget in (1.0, 0.8, 0.6, 0.4, 0.2):
        report = _compiled_step(case, {"memory_budget": budget})[3]
        baseline = report["baseline_saved_bytes"]
        assert report["saved_bytes"] <= budget * baseline, (budget, report["saved_bytes"], baseline)
        assert abs(report["saved_bytes"] - report["predicted_saved_bytes"]) <= 0.02 * baseline  # the model predicts the partitioner
        measured.append((report["saved_bytes"], report["recompute_flops"]))
    assert measured[0][1] == 0  # budget 1.0: nothing recomputed
    for (bytes_hi, flops_hi), (bytes_lo, flops_lo) in zip(measured, measured[1:]):
        assert bytes_lo <= bytes_hi and flops_lo >= flops_hi
    assert measured[-1][0] < 0.5 * measured[0][0]
    none = _compiled_step(case, {"policy": "none"})[3]
    assert measured[-1][0] < none["saved_bytes"]


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_full_saves_only_block_inputs_inside_blocks(name: str) -> None:
    case = build(name, **ZOO_CASES[name], n_layers=3)
    report = _compiled_step(case, {"policy": "full"})[3]
    none = _compiled_step(case, {"policy": "none"})[3]
    boundary = set(report["boundary"])
    inside = {n for n, block in report["saved_block"].items() if block is not None}
    assert inside, "a block's input should be saved"
    assert inside <= boundary, f"saved inside blocks but not block inputs: {sorted(inside - boundary)}"
    assert report["activation_bytes"] < 0.5 * none["activation_bytes"]
    # the checkpoint groups follow number_checkpoints
    grouped = _compiled_step(case, {"policy": "full", "number_checkpoints": 1})[3]
    assert grouped["notes"] == ["1 segments"] and report["notes"] == ["3 segments"]
    assert grouped["activation_bytes"] <= report["activation_bytes"]


def test_selective_never_recomputes_matmuls_or_attention() -> None:
    case = build("gpt")
    report = _compiled_step(case, {"policy": "selective"})[3]
    none = _compiled_step(case, {"policy": "none"})[3]
    expensive = [n for n in report["recomputed"] if n.split("_")[0] in ("mm", "addmm", "bmm") or "attention" in n]
    assert not expensive
    assert report["recomputed"], "cheap ops should be recomputed"
    assert report["saved_bytes"] < none["saved_bytes"]


def test_dump_writes_checkpointing_json(tmp_path) -> None:
    case = build("gpt")
    _compiled_step(case, {"memory_budget": 0.5}, dump=str(tmp_path))
    [path] = list(tmp_path.glob("*.joint/checkpointing.json"))
    data = json.loads(path.read_text())
    assert data["policy"] == "budget" and data["memory_budget"] == 0.5
    assert data["saved_bytes"] <= 0.5 * data["baseline_saved_bytes"] and data["recompute_flops"] > 0
    nodes = next(path.parent.glob("*_checkpoint/nodes.txt")).read_text()
    assert "MUST_RECOMPUTE" in nodes and '"checkpoint": "recompute"' in nodes


def test_cpu_checkpointing_is_a_logged_noop_on_cpu(caplog) -> None:
    ckpt._LOGGED_ONCE.discard("cpu_offload_cpu")
    case = build("gpt")
    with caplog.at_level(logging.WARNING, logger="dscompile.passes.checkpoint"):
        result = _compiled_step(case, {"policy": "full", "cpu_checkpointing": True})
    assert result[3]["offloaded"] == []
    assert "host memory" in caplog.text
    _assert_same(_eager_step(case), result)


def test_host_offload_rewrite_keeps_numerics(monkeypatch) -> None:
    """The offload rewrite itself, exercised on CPU by routing CPU tensors through host copies."""
    from dscompile.runtime.activation_offload import offload_saved_activations

    def offload_even_on_cpu(fw, bw, num_fwd_outputs, names):
        moved = offload_saved_activations(fw, bw, num_fwd_outputs, names, include_cpu=True)
        copies = [n for n in fw.graph.nodes if n.target is torch.ops.aten._to_copy.default]
        assert len(copies) == len(moved) == len(names) > 0
        return moved

    monkeypatch.setattr(ckpt, "_offload", offload_even_on_cpu)
    case = build("llama")
    result = _compiled_step(case, {"memory_budget": 0.5, "cpu_checkpointing": True})
    assert result[3]["offloaded"]
    _assert_same(_eager_step(case), result)


def test_config_section_and_pipeline_text() -> None:
    config = load_config({"activation_checkpointing": {"partition_activations": False, "number_checkpoints": 2, "profile": True,
                                                       "synchronize_checkpoint_boundary": True}})
    section = config.sections["activation_checkpointing"]
    assert section.policy == "full" and section.number_checkpoints == 2
    assert load_config({"activation_checkpointing": {"memory_budget": 0.3}}).sections["activation_checkpointing"].policy == "budget"
    [inv] = parse_pipeline("checkpoint(budget=0.5)")
    assert inv.options.resolved_policy() == "budget" and inv.options.budget == 0.5


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"memory_budget": 1.5}, "memory_budget"),
        ({"policy": "budget"}, "memory_budget"),
        ({"policy": "full", "memory_budget": 0.5}, "memory_budget"),
        ({"policy": "sometimes"}, "policy"),
        ({"number_checkpoints": 0}, "number_checkpoints"),
        ({"cpu_checkpointng": True}, "cpu_checkpointng"),
    ],
)
def test_config_errors_name_the_key(section: dict, key: str) -> None:
    with pytest.raises(DSCompileConfigError, match=key):
        load_config({"activation_checkpointing": section})


def test_contiguous_memory_optimization_is_refused() -> None:
    with pytest.raises(DSCompileNotSupportedError, match="contiguous_memory_optimization"):
        load_config({"activation_checkpointing": {"contiguous_memory_optimization": True}})


def test_partition_activations_across_ranks_is_refused() -> None:
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    ctx = PassContext(config=load_config({}), graph_kind="joint", graph_name="g.joint", world_size=2, num_fwd_outputs=1)
    with pytest.raises(DSCompileNotSupportedError, match="partition_activations"):
        ckpt.checkpoint(gm, ctx, ckpt.CheckpointOptions(policy="full", partition_activations=True))


def test_collectives_are_recomputed_only_when_marked() -> None:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    gathered = graph.call_function(torch.ops._c10d_functional.all_gather_into_tensor.default, (x, 2, "0"))
    waited = graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (gathered,))
    relu = graph.call_function(torch.ops.aten.relu.default, (waited,))
    graph.output(relu)
    assert ckpt._ban_reason(gathered) == ckpt._ban_reason(waited) == "collective not marked recomputable"
    assert ckpt._ban_reason(relu) is None
    for node in (gathered, waited):
        node.meta.setdefault("dscompile", {})["recomputable"] = True
    assert ckpt._ban_reason(gathered) is None and ckpt._ban_reason(waited) is None
