"""Activation checkpointing pass: numerics against eager, saved bytes against budgets, cost model, config, dump.

Compiles are the cost of these tests, so each (model, policy) is compiled once per session and
shared by the tests that look at it, and the budget sweep partitions one captured joint graph
at every budget (the pass and AOTAutograd's partitioner, without re-tracing).

Dropout: the compiled step draws random numbers in the same order as eager on CPU, and the
partitioner replays recomputed dropouts from the forward's saved generator state, so compiled
results with any policy equal eager with the same seed (checked exactly below, masks included).
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from dscompile import cost
from dscompile.config import load_config
from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError
from dscompile.passes import checkpointing as ckpt
from dscompile.pipeline import PassContext, parse_pipeline
from dscompile.zoo import build

POLICIES = {"none": {"policy": "none"}, "full": {"policy": "full"}, "selective": {"policy": "selective"}, "budget": {"memory_budget": 0.4}}
MODELS = {"gpt": {"dropout": 0.1}, "gpt_explicit": {"dropout": 0.1}, "llama": {}, "bert": {"dropout": 0.1}, "mlp": {}, "cnn": {}}
DUMP = Path(tempfile.mkdtemp(prefix="dscompile-ckpt-"))


def _train_step(model: torch.nn.Module, batch: tuple[torch.Tensor, ...], seed: int = 7) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    torch.manual_seed(seed)
    loss = model(*batch)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], torch.get_rng_state()


def _compiled_step(case: Any, ac: dict, **options: Any) -> tuple[Any, ...]:
    torch._dynamo.reset()
    ckpt.clear_reports()
    model = copy.deepcopy(case.model)
    compiled = torch.compile(model, backend="dscompile", options={"lower": "eager", "activation_checkpointing": ac, **options})
    loss, grads, rng = _train_step(compiled, case.batch())
    reports = ckpt.checkpoint_reports()
    assert len(reports) == 1, "one Dynamo graph expected for zoo models"
    return loss, grads, rng, reports[0]


@functools.cache
def _eager(name: str) -> tuple[Any, ...]:
    case = build(name, **MODELS[name])
    return _train_step(copy.deepcopy(case.model), case.batch())


@functools.cache
def _compiled(name: str, policy: str) -> tuple[Any, ...]:
    """One compile per (model, policy) for the whole session; gpt's budget run also writes a dump
    (without Graphviz rendering, which takes minutes on a joint graph and is not under test here)."""
    if (name, policy) != ("gpt", "budget"):
        return _compiled_step(build(name, **MODELS[name]), POLICIES[policy])
    with mock.patch("dscompile.dump.render_svg", lambda _dot: None):
        return _compiled_step(build(name, **MODELS[name]), POLICIES[policy], dump=str(DUMP))


def _assert_same(eager: tuple[Any, ...], compiled: tuple[Any, ...]) -> None:
    loss, grads, rng = eager
    c_loss, c_grads, c_rng = compiled[:3]
    torch.testing.assert_close(c_loss, loss, rtol=1e-5, atol=1e-6)
    for g, cg in zip(grads, c_grads):
        torch.testing.assert_close(cg, g, rtol=1e-4, atol=1e-5)
    # the compiled step consumed the global generator exactly as eager did
    assert torch.equal(rng, c_rng)


# -- numerics: every policy on both transformer families, one policy on each other zoo model ------------------


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_every_policy_matches_eager(name: str, policy: str) -> None:
    _assert_same(_eager(name), _compiled(name, policy))


@pytest.mark.parametrize(("name", "policy"), [("gpt_explicit", "budget"), ("bert", "selective"), ("mlp", "full"), ("cnn", "budget")])
def test_other_zoo_models_match_eager(name: str, policy: str) -> None:
    _assert_same(_eager(name), _compiled(name, policy))


@pytest.mark.parametrize("budget", [1.0, 0.8, 0.6, 0.2])
def test_every_budget_matches_eager_with_dropout(budget: float) -> None:
    """The budgets the sweep below measures (0.4 is covered above), run for real on gpt with dropout 0.1."""
    result = _compiled_step(build("gpt", **MODELS["gpt"]), {"memory_budget": budget})
    _assert_same(_eager("gpt"), result)
    report = result[3]
    assert report["saved_bytes"] <= budget * report["baseline_saved_bytes"]


def test_dropout_is_replayed_not_redrawn() -> None:
    """gpt has dropout 0.1: with full recomputation every dropout runs again in backward, from the
    forward's generator state, and the gradients (masks included) still equal eager's."""
    report = _compiled("gpt", "full")[3]
    assert report["rng_replays"] > 0 and report["rng_state_bytes"] > 0
    _assert_same(_eager("gpt"), _compiled("gpt", "full"))


# -- what gets saved -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_full_saves_only_block_inputs_inside_blocks(name: str) -> None:
    report, none = _compiled(name, "full")[3], _compiled(name, "none")[3]
    boundary = set(report["boundary"])
    inside = {n for n, block in report["saved_block"].items() if block is not None}
    assert inside, "a block's input should be saved"
    assert inside <= boundary, f"saved inside blocks but not block inputs: {sorted(inside - boundary)}"
    assert report["notes"] == ["2 segments"]
    assert report["activation_bytes"] < 0.5 * none["activation_bytes"]


def test_selective_never_recomputes_matmuls_or_attention() -> None:
    report, none = _compiled("gpt", "selective")[3], _compiled("gpt", "none")[3]
    expensive = [n for n in report["recomputed"] if n.split("_")[0] in ("mm", "addmm", "bmm") or "attention" in n]
    assert not expensive
    assert report["recompute_matmul_flops"] == 0
    assert report["recomputed"], "cheap ops should be recomputed"
    assert report["saved_bytes"] < none["saved_bytes"]


@dataclass
class Joint:
    """A joint graph as AOTAutograd hands it to the partitioner, with what the partitioner needs."""

    graph: torch.fx.GraphModule
    inputs: Any
    num_fwd_outputs: int
    kwargs: dict[str, Any]

    def partition(self, pins: dict[str, Any] | None = None, **options: Any) -> dict[str, Any]:
        """Run the checkpoint pass and its partition function on a copy; the measured report.
        ``pins``: node name -> ``meta["recompute"]`` set before the pass, as an earlier pass would."""
        from torch._guards import detect_fake_mode

        joint = copy.deepcopy(self.graph)
        for node in joint.graph.nodes:
            if pins and node.name in pins:
                node.meta["recompute"] = pins[node.name]
        ctx = PassContext(config=load_config({}), graph_kind="joint", graph_name="g.joint", world_size=1,
                          num_fwd_outputs=self.num_fwd_outputs, example_inputs=self.inputs)
        ckpt.checkpoint(joint, ctx, ckpt.CheckpointOptions(**options))
        with detect_fake_mode(self.inputs):
            ctx.analysis["partition_fn"](joint, self.inputs, num_fwd_outputs=self.num_fwd_outputs, **self.kwargs)
        return ctx.analysis["checkpointing"]["g.joint"]


@pytest.fixture(scope="module")
def gpt_joint() -> Joint:
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    captured: list[Joint] = []

    def partition(joint, inputs, *, num_fwd_outputs, **kwargs):
        captured.append(Joint(copy.deepcopy(joint), inputs, num_fwd_outputs, kwargs))
        return min_cut_rematerialization_partition(joint, inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)

    case = build("gpt", **MODELS["gpt"])
    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=lambda gm, _: gm.forward, bw_compiler=lambda gm, _: gm.forward, partition_fn=partition,
                           keep_inference_input_mutations=True)
    torch.compile(copy.deepcopy(case.model), backend=backend)(*case.batch()).backward()
    torch._dynamo.reset()
    return captured[0]


def test_saved_bytes_fall_with_the_budget_and_meet_it(gpt_joint: Joint) -> None:
    none = gpt_joint.partition(policy="none")
    measured = []
    for budget in (1.0, 0.8, 0.6, 0.4, 0.2):
        report = gpt_joint.partition(budget=budget)
        reference = report["no_checkpointing_saved_bytes"]
        assert reference == none["saved_bytes"]  # the scale is what a compile without checkpointing saves
        assert report["saved_bytes"] <= budget * reference, (budget, report["saved_bytes"], reference)
        assert abs(report["saved_bytes"] - report["predicted_saved_bytes"]) <= 0.02 * reference  # the model predicts the partitioner
        assert report["recompute_seconds"] == pytest.approx(report["predicted_recompute_seconds"], rel=0.05, abs=1e-9)
        measured.append(report)
    assert measured[0]["recompute_flops"] == 0  # budget 1.0: nothing recomputed
    for hi, lo in zip(measured, measured[1:]):
        assert lo["saved_bytes"] <= hi["saved_bytes"] and lo["recompute_seconds"] >= hi["recompute_seconds"]
    assert measured[-1]["saved_bytes"] < 0.5 * measured[0]["saved_bytes"]
    # a mild budget is met by recomputing bandwidth-bound ops alone: no matmul is worth its time there
    assert measured[1]["recompute_matmul_flops"] == 0 < measured[1]["recompute_seconds"]
    assert measured[-1]["recompute_matmul_flops"] > 0


def test_number_checkpoints_groups_blocks(gpt_joint: Joint) -> None:
    per_block = gpt_joint.partition(policy="full")
    grouped = gpt_joint.partition(policy="full", number_checkpoints=1)
    assert per_block["notes"] == ["2 segments"] and grouped["notes"] == ["1 segments"]
    assert grouped["activation_bytes"] < per_block["activation_bytes"]  # one block input fewer
    assert grouped["recompute_flops"] >= per_block["recompute_flops"]


def test_earlier_passes_pins_are_honoured(gpt_joint: Joint) -> None:
    """A pass before this one (ZeRO-3 pins its parameter gathers to MUST_RECOMPUTE) or the user may
    tag nodes; no policy overrides them, not even ``full``, which otherwise saves everything outside blocks."""
    from torch.utils.checkpoint import CheckpointPolicy

    full = gpt_joint.partition(policy="full")
    outside = next(n for n, block in full["saved_block"].items() if block is None)
    inside = next(n for n in full["recomputed"] if n.split("_")[0] in ("mm", "addmm", "bmm"))
    pinned = gpt_joint.partition(policy="full", pins={outside: CheckpointPolicy.MUST_RECOMPUTE, inside: CheckpointPolicy.MUST_SAVE})
    assert "recomputed" in pinned, (outside, inside, pinned["notes"])
    assert outside not in pinned["saved"] and outside in pinned["recomputed"]
    assert inside in pinned["saved"] and inside not in pinned["recomputed"]
    keep_all = gpt_joint.partition(budget=1.0)
    assert keep_all["recompute_flops"] == 0
    victim = next(n for n in keep_all["saved"] if n.split("_")[0] in ("mm", "addmm", "bmm"))
    pinned = gpt_joint.partition(budget=1.0, pins={victim: CheckpointPolicy.MUST_RECOMPUTE})
    assert victim in pinned["recomputed"] and victim not in pinned["saved"] and pinned["recompute_matmul_flops"] > 0
    # a pinned value is not kept alive through a saved view of it either (ZeRO-3's gathered weights are read through views)
    view = next(n for n in gpt_joint.graph.graph.nodes if n.name in keep_all["saved"] and ckpt._aliases_first_input(n)
                and n.args[0].op == "call_function")
    base = view.args[0].name
    pinned = gpt_joint.partition(budget=1.0, pins={base: CheckpointPolicy.MUST_RECOMPUTE})
    assert view.name not in pinned["saved"] and base not in pinned["saved"], (view.name, base)


# -- the recompute cost model ---------------------------------------------------------------------------------


def _traced(fn: Any, *shapes: tuple[int, ...]) -> torch.fx.GraphModule:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode() as mode:
        args = [mode.from_tensor(torch.empty(s)) for s in shapes]
        return make_fx(fn)(*args)


def test_roofline_prices_matmuls_by_flops_and_pointwise_by_bytes() -> None:
    gm = _traced(lambda a, b: torch.relu(a @ b).sum(), (256, 256), (256, 256))
    nodes = {str(n.target).split(".")[1]: n for n in gm.graph.nodes if n.op == "call_function"}
    cpu = cost.ROOFLINES["cpu"]
    mm = ckpt.recompute_seconds(nodes["mm"], {}, cpu)
    relu = ckpt.recompute_seconds(nodes["relu"], {}, cpu)
    total = ckpt.recompute_seconds(nodes["sum"], {}, cpu)
    elements = 256 * 256
    assert ckpt.is_matmul_class(nodes["mm"]) and not ckpt.is_matmul_class(nodes["relu"])
    assert mm == pytest.approx(2 * 256**3 / cpu.matmul_flops)  # compute-bound: FLOPs at matmul throughput
    assert relu == pytest.approx(2 * 4 * elements / cpu.bandwidth)  # bandwidth-bound: read + write
    assert total == pytest.approx(4 * elements / cpu.bandwidth, rel=1e-3)  # a reduction reads its input
    # one FLOP per element: priced as a matmul FLOP, relu would look 30x cheaper than it is
    assert relu > 10 * elements / cpu.matmul_flops
    views = [n for n in gm.graph.nodes if n.op == "call_function" and "view" in str(n.target)]
    assert all(ckpt.recompute_seconds(n, {}, cpu) == 0.0 for n in views)


def test_roofline_per_device() -> None:
    assert cost.roofline_for("cpu") is cost.ROOFLINES["cpu"]
    assert cost.roofline_for(torch.device("cuda", 1)) is cost.ROOFLINES["cuda"]
    for roof in cost.ROOFLINES.values():
        # the ratios that steer the cut: matmul units outrun vector units, both outrun memory
        assert roof.matmul_flops > roof.vector_flops > roof.bandwidth / 4


# -- dump, offload, config -------------------------------------------------------------------------------------


def test_dump_writes_checkpointing_json() -> None:
    _compiled("gpt", "budget")
    [path] = list(DUMP.glob("*.joint/checkpointing.json"))
    data = json.loads(path.read_text())
    assert data["policy"] == "budget" and data["memory_budget"] == 0.4
    assert data["saved_bytes"] <= 0.4 * data["baseline_saved_bytes"] and data["recompute_flops"] > 0
    assert data["recompute_seconds"] > 0 and data["forward_seconds"] > data["recompute_seconds"]
    nodes = next(path.parent.glob("*_checkpoint/nodes.txt")).read_text()
    assert "MUST_RECOMPUTE" in nodes and '"checkpoint": "recompute"' in nodes


def test_cpu_checkpointing_is_a_logged_noop_on_cpu(caplog: pytest.LogCaptureFixture) -> None:
    ckpt._LOGGED_ONCE.discard("cpu_offload_cpu")
    case = build("mlp")
    with caplog.at_level(logging.WARNING, logger="dscompile.passes.checkpoint"):
        result = _compiled_step(case, {"policy": "full", "cpu_checkpointing": True})
    assert result[3]["offloaded"] == []
    assert "host memory" in caplog.text
    _assert_same(_eager("mlp"), result)
    with caplog.at_level(logging.WARNING, logger="dscompile.passes.checkpoint"):
        _compiled_step(case, {"memory_budget": 0.5, "cpu_checkpointing": True})  # a second compile says nothing more
    assert sum("host memory" in r.getMessage() for r in caplog.records) == 1


def test_host_offload_rewrite_keeps_numerics(monkeypatch: pytest.MonkeyPatch) -> None:
    """The offload rewrite itself, exercised on CPU by routing CPU tensors through host copies."""
    from dscompile.runtime.activation_offload import offload_saved_activations

    def offload_even_on_cpu(fw, bw, num_fwd_outputs, names):
        moved = offload_saved_activations(fw, bw, num_fwd_outputs, names, include_cpu=True)
        copies = [n for n in fw.graph.nodes if n.target is torch.ops.aten._to_copy.default]
        assert len(copies) == len(moved) == len(names) > 0
        return moved

    monkeypatch.setattr(ckpt.partition, "_offload", offload_even_on_cpu)  # where the partition function looks it up
    case = build("llama", n_layers=1)
    result = _compiled_step(case, {"memory_budget": 0.5, "cpu_checkpointing": True})
    assert result[3]["offloaded"]
    _assert_same(_train_step(copy.deepcopy(case.model), case.batch()), result)


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


@pytest.mark.parametrize("wrapper", ["run_with_rng_state", "graphsafe_run_with_rng_state"])
def test_the_cost_model_sees_into_replayed_random_ops_of_both_wrappers(wrapper: str) -> None:
    """The partitioner replays a checkpointed dropout through ``run_with_rng_state(rng_state, op, *args)``
    on CPU and ``graphsafe_run_with_rng_state(op, *args, rng_state=...)`` on CUDA: the cost model prices
    the wrapped op either way (the CUDA form once crashed every checkpointed dropout on a GPU)."""
    from torch._prims.rng_prims import graphsafe_run_with_rng_state, run_with_rng_state

    from dscompile.passes.checkpointing import _unwrap_rng

    graph = torch.fx.Graph()
    x, state = graph.placeholder("x"), graph.placeholder("rng_state")
    x.meta["val"] = torch.empty(4, 8)
    state.meta["val"] = torch.empty(16, dtype=torch.uint8)
    op = torch.ops.aten.native_dropout.default
    if wrapper == "run_with_rng_state":
        node = graph.call_function(run_with_rng_state, (state, op, x, 0.1, True))
    else:
        node = graph.call_function(graphsafe_run_with_rng_state, (op, x, 0.1, True), {"rng_state": state})
    node.meta["val"] = (torch.empty(4, 8), torch.empty(4, 8, dtype=torch.bool))
    inner = _unwrap_rng(node)
    assert inner.target is op
    assert [a.meta["val"].shape for a in inner.args[:1]] == [torch.Size([4, 8])] and inner.args[1:] == (0.1, True)
    assert "rng_state" not in inner.kwargs
