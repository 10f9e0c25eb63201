"""The ``amp`` pass against torch.autocast (+ torch.amp.GradScaler) on the zoo models.

- op dtypes: with ``policy=autocast`` the transformed graph runs exactly the ops, in exactly the
  dtypes, that eager code under ``torch.autocast("cpu")`` runs (recorded at the aten level);
  with the default policy, matmul-class ops are low precision and norms/softmax/losses fp32;
- training: 20 steps of ``dscompile.initialize`` with ``bf16``/``fp16`` against eager autocast
  + GradScaler: losses and gradients agree within the precision's tolerance;
- casts: once per value, redundant ones folded, counts recorded; config errors name the keys.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import dscompile
from dscompile.config import load_config
from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError
from dscompile.frontend import _parameter_names
from dscompile.graph import ds_meta, node_value
from dscompile.passes.mixed_precision import AmpOptions, amp_pass, cast_source, op_key
from dscompile.pipeline import PassContext, pipeline_from_config
from dscompile.zoo import build, make_batch

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
MODELS = ["gpt", "llama"]

# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _dynamo_graph(model: nn.Module, batch: tuple) -> tuple[torch.fx.GraphModule, list]:
    captured: dict = {}

    def capture(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        captured["gm"], captured["inputs"] = gm, example_inputs
        return gm.forward

    torch.compile(model, backend=capture, fullgraph=True)(*batch)
    return captured["gm"], captured["inputs"]


def _amp_graph(model: nn.Module, batch: tuple, **options: object) -> tuple[torch.fx.GraphModule, list, PassContext]:
    gm, inputs = _dynamo_graph(model, batch)
    ctx = PassContext(
        config=load_config({}),
        graph_kind="pre_autograd",
        graph_name="test.dynamo",
        example_inputs=inputs,
        param_names=_parameter_names(gm, inputs),
    )
    gm = amp_pass(gm, ctx, AmpOptions(**options))
    return gm, inputs, ctx


_LAYOUT_OPS = {
    "_to_copy", "view", "t", "transpose", "detach", "_unsafe_view", "reshape", "expand", "alias", "permute",
    "split", "split_with_sizes", "clone", "unsqueeze", "squeeze", "slice", "select", "lift_fresh", "convert_element_type",
}  # fmt: skip


class _OpRecorder(TorchDispatchMode):
    """Records (aten op, result dtype) of every computing op, skipping casts and layout ops."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, torch.dtype | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if func._opname not in _LAYOUT_OPS:
            first = out[0] if isinstance(out, (tuple, list)) else out
            self.ops.append((func._opname, getattr(first, "dtype", None)))
        return out


# ---------------------------------------------------------------------------------------------
# op dtypes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_autocast_policy_matches_torch_autocast_op_by_op(name: str, precision: str) -> None:
    case = build(name)
    gm, inputs, _ = _amp_graph(case.model, case.batch(), dtype=precision, policy="autocast")
    with torch.no_grad():
        ref = _OpRecorder()
        with torch.autocast("cpu", dtype=LOW[precision]), ref:
            ref_loss = case.model(*case.batch())
        ours = _OpRecorder()
        with ours:
            loss = gm(*inputs)[0]
    assert ours.ops == ref.ops
    assert any(dtype == LOW[precision] for _, dtype in ours.ops)
    # same casts in the same places: the forward is bit-identical to autocast's
    assert torch.equal(loss, ref_loss)


@pytest.mark.parametrize("name", ["gpt_explicit", "llama"])
def test_default_policy_low_matmuls_fp32_sensitive_ops(name: str) -> None:
    case = build(name)
    gm, _, ctx = _amp_graph(case.model, case.batch(), dtype="bf16")
    seen: dict[str, set] = {}
    for node in gm.graph.nodes:
        key = op_key(node)
        value = node_value(node)
        if key and isinstance(value, torch.Tensor) and value.is_floating_point():
            seen.setdefault(key, set()).add(value.dtype)
            assert ds_meta(node)["dtype"] == value.dtype  # metadata later passes read
    low = {"linear", "matmul", "scaled_dot_product_attention"} & seen.keys()
    fp32 = {"softmax", "layer_norm", "rms_norm", "cross_entropy"} & seen.keys()
    assert "linear" in low and "cross_entropy" in fp32 and len(fp32) >= 2
    for key in low:
        assert seen[key] == {torch.bfloat16}, key
    for key in fp32:
        assert seen[key] == {torch.float32}, key
    # parameters stay fp32 placeholders; the graph casts each one at most once per dtype
    sources = [(cast_source(n)[0], cast_source(n)[1]) for n in gm.graph.nodes if cast_source(n)]
    assert len(sources) == len(set(sources))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for index in ctx.param_names:
        assert node_value(placeholders[index]).dtype == torch.float32
    assert any("amp_param_cast" in ds_meta(n) for n in gm.graph.nodes)
    stats = ctx.analysis["amp"]["test.dynamo"]
    assert stats["casts_inserted"] == stats["casts_before_cleanup"] > 0
    assert stats["casts_requested"] >= stats["casts_inserted"]


# ---------------------------------------------------------------------------------------------
# training: 20 steps against autocast + GradScaler
# ---------------------------------------------------------------------------------------------

STEPS = 20
# Relative to the norm of all gradients / the loss. With policy=autocast the casts are autocast's
# own, so only AOTAutograd-vs-eager backward rounding separates the two. The default policy keeps
# norms, softmax and pow in fp32 where CPU autocast runs them in the low precision, so it differs
# from autocast by about the low precision's rounding, and must be at least as close to fp32.
TOL = {
    ("autocast", "bf16"): {"loss": 5e-3, "grad": 3e-2},
    ("autocast", "fp16"): {"loss": 1e-3, "grad": 4e-2},
    ("default", "bf16"): {"loss": 2e-2, "grad": 5e-2},
    ("default", "fp16"): {"loss": 4e-3, "grad": 4e-2},
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _flat_grads(model: nn.Module, scale: float = 1.0) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) / scale for p in model.parameters()])


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("policy", ["default", "autocast"])
def test_training_matches_autocast_and_gradscaler(name: str, precision: str, policy: str) -> None:
    case, ref_case, fp32_case = build(name), build(name), build(name)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0}},
        precision: {"enabled": True, **({"hysteresis": 1} if precision == "fp16" else {})},
        "lower": "eager",
    }
    if policy == "autocast":
        config["pipeline"] = f"amp(dtype={precision},policy=autocast),cse,dce,lower(eager)"
    engine, _, _, _ = dscompile.initialize(model=case.model, config=config)
    ref_opt = torch.optim.AdamW(ref_case.model.parameters(), lr=3e-3, weight_decay=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=1000, enabled=precision == "fp16")
    assert engine.loss_scaler.loss_scale == (2.0**16 if precision == "fp16" else 1.0)  # bf16: check_grad_overflow
    tol = TOL[(policy, precision)]
    for step in range(STEPS):
        batch = make_batch(case, seed=100 + step)
        loss = engine(*batch)
        engine.backward(loss)
        grads = _flat_grads(engine.module, engine.loss_scaler.loss_scale if engine.loss_scaler else 1.0)
        with torch.autocast("cpu", dtype=LOW[precision]):
            ref_loss = ref_case.model(*batch)
        scaler.scale(ref_loss).backward()
        scaler.unscale_(ref_opt)
        ref_grads = _flat_grads(ref_case.model)
        assert abs(loss.item() - ref_loss.item()) <= tol["loss"] * abs(ref_loss.item()), step
        assert _rel(grads, ref_grads) <= tol["grad"], (step, _rel(grads, ref_grads))
        if step == 0 and policy == "default":
            fp32_case.model(*batch).backward()
            exact = _flat_grads(fp32_case.model)
            assert _rel(grads, exact) <= 1.1 * _rel(ref_grads, exact) + 1e-3
        engine.step()
        scaler.step(ref_opt)
        scaler.update()
        ref_opt.zero_grad(set_to_none=True)
        if engine.loss_scaler:
            assert engine.loss_scaler.loss_scale == scaler.get_scale()
    assert engine.skipped_steps == 0
    # parameters stayed fp32 masters and moved like the reference
    for (n, p), q in zip(engine.module.named_parameters(), ref_case.model.parameters()):
        assert p.dtype == torch.float32
        assert _rel(p.detach(), q.detach()) <= 2e-2, n


# ---------------------------------------------------------------------------------------------
# cast clean-up
# ---------------------------------------------------------------------------------------------


class _UserCasts(nn.Module):
    """Model code with casts of its own, which become redundant once the graph computes in bf16."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x).float().to(torch.bfloat16)  # bf16 -> fp32 -> bf16: the identity
        h = torch.relu(h)
        return self.fc2(h.float()).float().sum()  # fc2 casts its fp32 input back to bf16


def test_redundant_casts_are_folded_exactly() -> None:
    model = _UserCasts()
    x = torch.randn(4, 8)
    gm, inputs, ctx = _amp_graph(model, (x,), dtype="bf16")
    stats = ctx.analysis["amp"]["test.dynamo"]
    assert stats["casts_after_cleanup"] < stats["casts_before_cleanup"]
    assert stats["casts_removed"] == stats["casts_before_cleanup"] - stats["casts_after_cleanup"]
    # no cast chain is left whose middle dtype held the source exactly
    for node in gm.graph.nodes:
        found = cast_source(node)
        if found and cast_source(found[0]):
            inner_src, inner_dtype = cast_source(found[0])
            assert not (node_value(inner_src).dtype in (torch.bfloat16, torch.float16) and inner_dtype == torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
    assert torch.equal(gm(*inputs)[0], expected)


def test_counts_recorded_for_aot_graphs_and_dump(tmp_path) -> None:
    case = build("gpt", n_layers=1)
    compiled = torch.compile(case.model, backend="dscompile", options={"bf16": {"enabled": True}, "lower": "eager", "dump": str(tmp_path)})
    compiled(*case.batch()).backward()
    tables = {p.name: p.read_text() for p in tmp_path.rglob("*") if p.is_file() and "amp" in p.name and p.suffix == ".txt"}
    text = "\n".join(tables.values()) or "\n".join(p.read_text(errors="ignore") for p in tmp_path.rglob("*.txt"))
    assert "bf16" in text and "casts_after_cleanup" in text


# ---------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------


def test_config_maps_to_amp_pipeline() -> None:
    specs = [inv.spec() for inv in pipeline_from_config(load_config({"fp16": {"enabled": True}}))]
    assert specs[0] == "amp(dtype=fp16)"
    specs = [inv.spec() for inv in pipeline_from_config(load_config({"bf16": {"enabled": True}}))]
    assert specs[0] == "amp"
    specs = [inv.spec() for inv in pipeline_from_config(load_config({"bf16": {"enabled": False}}))]
    assert not any(s.startswith("amp") for s in specs)


def test_fp16_and_bf16_together_name_both_keys() -> None:
    config = {"fp16": {"enabled": True}, "bf16": {"enabled": True}}
    with pytest.raises(DSCompileConfigError, match=r"bf16\.enabled.*fp16\.enabled"):
        pipeline_from_config(load_config(config))
    with pytest.raises(DSCompileConfigError, match=r"bf16\.enabled.*fp16\.enabled"):
        dscompile.initialize(model=nn.Linear(2, 2), config=config)


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ({"fp16": {"enabled": True, "auto_cast": True}}, "fp16.auto_cast"),
        ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, "fp16.fp16_master_weights_and_grads"),
    ],
)
def test_unbuilt_fp16_keys_are_refused(section: dict, match: str) -> None:
    with pytest.raises(DSCompileNotSupportedError, match=match):
        load_config(section)


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ({"fp16": {"enabled": True, "loss_scale_windw": 10}}, "loss_scale_window"),
        ({"fp16": {"enabled": True, "hysteresis": 0}}, "fp16.hysteresis"),
        ({"fp16": {"enabled": True, "loss_scale": -1}}, "fp16.loss_scale"),
        ({"bf16": {"enabled": "auto"}}, "bf16.enabled"),
    ],
)
def test_bad_mixed_precision_keys(section: dict, match: str) -> None:
    with pytest.raises(DSCompileConfigError, match=match):
        load_config(section)


def test_half_parameters_are_refused_by_the_engine() -> None:
    with pytest.raises(DSCompileConfigError, match="fp32 master weights"):
        dscompile.initialize(model=nn.Linear(2, 2).half(), config={"fp16": {"enabled": True}})


def test_options_are_json_serialisable_in_analysis() -> None:
    case = build("mlp")
    _, _, ctx = _amp_graph(case.model, case.batch(), dtype="fp16")
    json.dumps(ctx.analysis["amp"])
