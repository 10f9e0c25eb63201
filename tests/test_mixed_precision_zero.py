"""Mixed precision composed with ZeRO on 2 gloo ranks, and ``communication_data_type``.

- training: bf16 and fp16 with ZeRO-2 and ZeRO-3, 20 steps, losses and gradients every step and
  the final parameters against one process running ``torch.autocast`` + ``torch.amp.GradScaler`` on
  every rank's micro-batch (mean loss, as data parallelism computes it); the optimizer steps fp32
  shards (master weights, with fp32 sharded Adam state);
- the compiled graphs: ZeRO-3 all-gathers carry the low-precision shard (the cast is before the
  gather, so half the bytes travel, in forward and in backward's re-gather), gradient
  reduce-scatters carry ``communication_data_type`` (default: the training precision);
- fp16 overflow on one rank only (an inf in one element of one rank's gradient shard) skips the
  step on every rank, leaves parameters and optimizer state bit-identical, and moves the loss
  scale identically on every rank (DeepSpeed's hysteresis, then halving);
- ``communication_data_type`` explicitly fp32 (bf16 training) and fp16 (fp32 training), and on the
  reductions done outside graphs (ZeRO-1, plain data parallelism); its config errors.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dscompile
from dscompile.config import load_config
from dscompile.errors import DSCompileConfigError
from dscompile.pipeline import pipeline_from_config
from dscompile.testing.distributed import requires_backend, run_distributed_or_fail
from dscompile.zoo import build, make_batch

WORLD = 2
STEPS = 20
LR = 3e-3
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODEL_KW: dict[str, Any] = {"seq_len": 8, "d_model": 16, "n_heads": 2, "n_layers": 1, "vocab_size": 40, "hidden_dim": 24}
GATHER = "all_gather_into_tensor"
SCATTER = "reduce_scatter_tensor"

# Relative to the loss / to the norm of all gradients / of each final parameter. Measured on this
# model (ZeRO-3, 20 steps): bf16 loss 1e-4, gradients 1.5e-2, parameters 2.1e-2 (autocast itself
# is 1.9e-2 from fp32: Adam turns low-precision rounding into parameter noise of that size); fp16
# loss 1e-5, gradients 7e-4, parameters 8e-4. ZeRO adds the reduction in the low precision and,
# with ZeRO-3, norm and embedding weights read from the low-precision gather (rounded as
# DeepSpeed's 16-bit weights are). The whole-model check in ``_check_training`` is calibrated:
# ZeRO mixed precision may not be farther from autocast than twice autocast's own distance from fp32.
TOL = {
    "bf16": {"loss": 2e-3, "grad": 5e-2, "param": 3e-2},
    "fp16": {"loss": 1e-3, "grad": 1e-2, "param": 5e-3},
    "fp32": {"loss": 1e-5, "grad": 1e-4, "param": 1e-5},
}


def _case() -> Any:
    return build("llama", seed=3, batch_size=2, **MODEL_KW)


def _batch(case: Any, step: int, rank: int) -> tuple[torch.Tensor, ...]:
    return make_batch(case, seed=20_000 + 10 * step + rank)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def reference_run(precision: str, steps: int = STEPS) -> dict[str, Any]:
    """One process, eager autocast + GradScaler: every rank's micro-batch, loss averaged over ranks."""
    case = _case()
    net = case.model
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=1000, enabled=precision == "fp16")
    losses, grads = [], []
    for step in range(steps):
        total = 0.0
        for rank in range(WORLD):
            with torch.autocast("cpu", dtype=LOW[precision], enabled=precision != "fp32"):
                loss = net(*_batch(case, step, rank)) / WORLD
            scaler.scale(loss).backward()
            total += loss.item()
        scaler.unscale_(opt)
        grads.append(torch.cat([p.grad.reshape(-1) for p in net.parameters()]).clone())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in net.named_parameters()}}


def _config(stage: int, precision: str, comm: str | None = None, fp16: dict | None = None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
        "lower": "eager",
    }
    if stage:
        cfg["zero_optimization"] = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if precision != "fp32":
        cfg[precision] = {"enabled": True, **(fp16 or {})}
    if comm is not None:
        cfg["communication_data_type"] = comm
    return cfg


def _record_collectives() -> list[tuple[str, str, torch.dtype, int]]:
    """Patch the pass manager so that every final forward/backward graph's collectives are recorded.

    Each entry: (graph kind, collective, dtype of its input, elements of its input).
    """
    from dscompile.graph import node_value
    from dscompile.pipeline import PassManager

    found: list[tuple[str, str, torch.dtype, int]] = []
    original = PassManager.run

    def run(self: PassManager, gm: torch.fx.GraphModule, ctx: Any) -> torch.fx.GraphModule:
        gm = original(self, gm, ctx)
        if ctx.graph_kind in ("forward", "backward"):
            for node in gm.graph.nodes:
                name = getattr(node.target, "_opname", None) if node.op == "call_function" else None
                name = SCATTER if name == "all_to_all_single" else name  # a ZeRO reduce-scatter on gloo (zero_gloo)
                if name in (GATHER, SCATTER) and node.target.namespace == "_c10d_functional":
                    value = node_value(node.args[0])
                    found.append((ctx.graph_kind, name, value.dtype, value.numel()))
        return gm

    PassManager.run = run  # type: ignore[method-assign]  # this rank process only
    return found


def _full_grads(engine: Any, scale: float) -> torch.Tensor:
    """Every parameter's averaged gradient, gathered from the shards and unscaled (a collective)."""
    pieces = []
    for layout, shard in zip(engine.zero.layouts, engine.zero.shards):
        grad = shard.grad.detach().float().reshape(-1) / scale
        parts = [torch.empty_like(grad) for _ in range(engine.world_size)]
        dist.all_gather(parts, grad)
        pieces.append(torch.cat(parts)[: layout.numel])
    return torch.cat(pieces)


def train_rank(rank: int, world: int, stage: int, precision: str, comm: str | None) -> dict[str, Any]:
    """One rank of dscompile ZeRO training: global losses, full gradients per step, final params, graph facts."""
    collectives = _record_collectives()
    torch.manual_seed(0)
    case = _case()
    engine, optimizer, _, _ = dscompile.initialize(model=case.model, config=_config(stage, precision, comm))
    losses, grads, scales = [], [], []
    for step in range(STEPS):
        loss = engine(*_batch(case, step, rank))
        engine.backward(loss)
        scale = engine.loss_scaler.loss_scale if engine.loss_scaler is not None else 1.0
        scales.append(scale)
        grads.append(_full_grads(engine, scale))
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    masters = [p for group in optimizer.param_groups for p in group["params"]]
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {
        "losses": losses,
        "grads": grads,
        "scales": scales,
        "skipped": engine.skipped_steps,
        "params": engine.full_parameters(),
        "master_dtypes": sorted({str(p.dtype) for p in masters + states}),
        "master_numel": sum(p.numel() for p in masters),
        "shard_numel": sum(layout.shard_numel for layout in engine.zero.layouts),
        "collectives": collectives,
    }


def _check_training(results: list[dict[str, Any]], ref: dict[str, Any], fp32: dict[str, Any], precision: str) -> None:
    tol = TOL[precision]
    for result in results:
        assert result["skipped"] == 0
        assert result["master_dtypes"] == ["torch.float32"]  # master weights and Adam state stay fp32
        assert result["master_numel"] == result["shard_numel"]  # ... and sharded: each rank steps its shard
        for step, (loss, ref_loss) in enumerate(zip(result["losses"], ref["losses"])):
            assert abs(loss - ref_loss) <= tol["loss"] * abs(ref_loss), (step, loss, ref_loss)
        for step, (grad, ref_grad) in enumerate(zip(result["grads"], ref["grads"])):
            assert _rel(grad, ref_grad) <= tol["grad"], (step, _rel(grad, ref_grad))
    for name, value in ref["params"].items():
        assert results[0]["params"][name].dtype == torch.float32
        assert _rel(results[0]["params"][name], value) <= tol["param"], (name, _rel(results[0]["params"][name], value))
    torch.testing.assert_close(results[0]["params"], results[1]["params"], rtol=0, atol=0)
    names = list(ref["params"])
    ours, autocast, exact = (torch.cat([d[n].reshape(-1) for n in names]) for d in (results[0]["params"], ref["params"], fp32["params"]))
    assert _rel(ours, autocast) <= 2 * _rel(autocast, exact) + 1e-3, (_rel(ours, autocast), _rel(autocast, exact))


def _dtypes(result: dict[str, Any], kind: str, collective: str) -> set[torch.dtype]:
    return {dtype for k, c, dtype, _ in result["collectives"] if k == kind and c == collective}


CASES = [("bf16", 2), ("bf16", 3), ("fp16", 2), ("fp16", 3)]


@pytest.mark.slow
@pytest.mark.distributed
@requires_backend("gloo")
@pytest.mark.parametrize("precision,stage", CASES, ids=[f"{p}-z{s}" for p, s in CASES])
def test_mixed_precision_with_zero_matches_autocast(precision: str, stage: int) -> None:
    results = run_distributed_or_fail(train_rank, WORLD, stage, precision, None, timeout=240)
    _check_training(results, reference_run(precision), reference_run("fp32"), precision)
    low = LOW[precision]
    for result in results:
        if precision == "fp16":
            assert result["scales"] == [2.0**16] * STEPS  # no overflow on this data: DeepSpeed's initial scale
        # Gradients are reduce-scattered in the training precision (DeepSpeed's default communication_data_type).
        assert _dtypes(result, "backward", SCATTER) == {low}
        if stage == 3:
            # The cast is before the all-gather: forward and backward's re-gathers move low-precision
            # shards only, so every gathered element costs 2 bytes instead of 4.
            assert _dtypes(result, "forward", GATHER) == {low}
            assert _dtypes(result, "backward", GATHER) == {low}
        else:
            assert not _dtypes(result, "forward", GATHER) and not _dtypes(result, "backward", GATHER)


# ---------------------------------------------------------------------------------------------
# the cast-before-gather rewrite itself (one process, a 1-rank gloo group: fast)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def one_rank_group() -> Any:
    """A 1-rank gloo process group for this test only, so ZeRO-3's gather op can run in-process."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _zero3_amp_graph(zero3_gather: str) -> tuple[torch.fx.GraphModule, list, Any, Any]:
    from dscompile.frontend import _parameter_names
    from dscompile.passes.mixed_precision import AmpOptions, amp_pass
    from dscompile.pipeline import PassContext
    from dscompile.runtime.zero_shard import shard_model

    case = _case()
    sharded = shard_model(case.model, stage=3)
    captured: dict[str, Any] = {}

    def capture(gm: torch.fx.GraphModule, inputs: list) -> Any:
        captured["gm"], captured["inputs"] = gm, inputs
        return gm.forward

    batch = case.batch()
    torch.compile(sharded, backend=capture, fullgraph=True)(*batch)
    gm, inputs = captured["gm"], captured["inputs"]
    ctx = PassContext(config=load_config({}), graph_kind="pre_autograd", graph_name="t.dynamo", example_inputs=inputs, param_names=_parameter_names(gm, inputs))
    gm = amp_pass(gm, ctx, AmpOptions(dtype="bf16", zero3_gather=zero3_gather))
    return gm, inputs, ctx, case


def _gathers(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    from dscompile.passes.mixed_precision import is_zero_gather

    return [n for n in gm.graph.nodes if is_zero_gather(n)]


def test_zero3_gathers_the_low_precision_shard(one_rank_group: Any) -> None:
    from dscompile.graph import node_value

    gm, inputs, ctx, case = _zero3_amp_graph("low")
    gathers = _gathers(gm)
    assert len(gathers) == len(list(case.model.parameters()))  # one per parameter, no fp32 gather left
    for node in gathers:
        assert node_value(node.args[0]).dtype == torch.bfloat16 and node_value(node).dtype == torch.bfloat16
    assert ctx.analysis["amp"]["t.dynamo"]["zero3_gathers_lowered"] == len(gathers)
    # fp32 users (RMS norms, the embedding) read the gathered bf16 copy upcast; matmuls read it directly.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _case().model(*case.batch())  # same seed, unsharded (sharding emptied case.model's tensors)
    loss = gm(*inputs)[0]
    assert loss.dtype == ref.dtype and abs(float(loss) - float(ref)) <= 2e-3 * abs(float(ref))


def test_zero3_exact_mode_keeps_fp32_gathers_for_fp32_users(one_rank_group: Any) -> None:
    from dscompile.graph import node_value

    gm, inputs, _, case = _zero3_amp_graph("exact")
    dtypes = [node_value(n.args[0]).dtype for n in _gathers(gm)]
    assert torch.bfloat16 in dtypes and torch.float32 in dtypes  # linears low; norms and the embedding exact
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _case().model(*case.batch())  # same seed, unsharded (sharding emptied case.model's tensors)
    assert abs(float(gm(*inputs)[0]) - float(ref)) <= 2e-3 * abs(float(ref))


# ---------------------------------------------------------------------------------------------
# fp16 overflow on one rank
# ---------------------------------------------------------------------------------------------


def _snapshot(engine: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "shards": [s.detach().clone() for s in engine.zero.shards],
        "full": [p.detach().clone() for p in engine.zero.full_params],
        "optimizer": copy.deepcopy(optimizer.state_dict()),
    }


def _bit_identical(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_bit_identical(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_bit_identical(x, y) for x, y in zip(a, b))
    return a == b


def overflow_rank(rank: int, world: int, stage: int) -> dict[str, Any]:
    """fp16 ZeRO training where one rank's gradients overflow: which steps were skipped, what changed."""
    torch.manual_seed(0)
    case = _case()
    engine, optimizer, _, _ = dscompile.initialize(model=case.model, config=_config(stage, "fp16", fp16={"hysteresis": 2}))
    record: dict[str, Any] = {"scales": [], "skipped": [], "unchanged": {}, "states": []}
    for step in range(6):
        loss = engine(*_batch(case, step, rank))
        if step == 3 and rank == 0:
            loss = loss * 2.0**20  # a real fp16 overflow inside rank 0's backward graph (inf reaches the reduce-scatter)
        engine.backward(loss)
        if step == 2 and rank == 1:
            with torch.no_grad():  # an inf in one element of rank 1's shard only: rank 0's gradients are clean
                engine.zero.shards[-1].grad.view(-1)[0] = float("inf")
        before = _snapshot(engine, optimizer) if step in (2, 3) else None
        engine.step()
        if before is not None:
            record["unchanged"][step] = _bit_identical(before, _snapshot(engine, optimizer))
        record["scales"].append(engine.loss_scaler.loss_scale)
        record["skipped"].append(engine.skipped_steps)
        record["states"].append(engine.loss_scaler.state_dict())
    record["params"] = engine.full_parameters()
    return record


@pytest.mark.slow
@pytest.mark.distributed
@requires_backend("gloo")
@pytest.mark.parametrize("stage", [2, 3])
def test_overflow_on_one_rank_skips_the_step_on_every_rank(stage: int) -> None:
    results = run_distributed_or_fail(overflow_rank, WORLD, stage, timeout=180)
    for result in results:
        # Steps 2 (inf on rank 1 only) and 3 (overflow on rank 0) skipped everywhere; with hysteresis 2 the
        # first overflow keeps the scale, the second halves it (DeepSpeed's schedule).
        assert result["skipped"] == [0, 0, 1, 2, 2, 2]
        assert result["scales"] == [2.0**16, 2.0**16, 2.0**16, 2.0**15, 2.0**15, 2.0**15]
        assert result["unchanged"] == {2: True, 3: True}  # parameters, full copies and Adam state bit-identical
    assert results[0]["states"] == results[1]["states"]
    torch.testing.assert_close(results[0]["params"], results[1]["params"], rtol=0, atol=0)
    for value in results[0]["params"].values():
        assert torch.isfinite(value).all()


# ---------------------------------------------------------------------------------------------
# communication_data_type
# ---------------------------------------------------------------------------------------------


def _record_eager_reductions() -> list[torch.dtype]:
    """Dtypes of the reductions the engine runs outside graphs (ZeRO-1, plain data parallelism)."""
    found: list[torch.dtype] = []
    for name in ("reduce_scatter_tensor", "all_to_all_single", "all_reduce"):  # ZeRO-1 on gloo: an all-to-all, summed after
        original = getattr(dist, name)

        def wrapped(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            tensor = args[0] if _name == "all_reduce" else args[1]
            if tensor.numel() > 1 and tensor.is_floating_point():  # the overflow flag and loss average are scalars, ZeRO-1's gradient counts integers
                found.append(tensor.dtype)
            return _original(*args, **kwargs)

        setattr(dist, name, wrapped)
    return found


def comm_rank(rank: int, world: int, stage: int, precision: str, comm: str, steps: int) -> dict[str, Any]:
    """A short run with an explicit communication_data_type: losses, final params, collective dtypes."""
    collectives = _record_collectives()
    eager = _record_eager_reductions()
    torch.manual_seed(0)
    case = _case()
    engine, _, _, _ = dscompile.initialize(model=case.model, config=_config(stage, precision, comm))
    losses = []
    for step in range(steps):
        loss = engine(*_batch(case, step, rank))
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    return {
        "losses": losses,
        "params": engine.full_parameters(),
        "collectives": collectives,
        "eager": sorted({str(d) for d in eager}),
        "engine_dtype": engine.communication_data_type,
    }


COMM_CASES = [
    # (stage, training precision, communication_data_type, steps)
    (3, "bf16", "fp32", STEPS),  # reduce in fp32 although gradients are bf16; gathers stay bf16
    (2, "fp32", "fp16", 10),  # fp32 training, fp16 reductions (DeepSpeed allows it)
    (1, "bf16", "fp16", 10),  # ZeRO-1 reduces outside the graphs
    (0, "fp32", "bf16", 10),  # plain data parallelism: the engine's all-reduce
]


@pytest.mark.slow
@pytest.mark.distributed
@requires_backend("gloo")
@pytest.mark.parametrize("stage,precision,comm,steps", COMM_CASES, ids=[f"z{s}-{p}-comm_{c}" for s, p, c, _ in COMM_CASES])
def test_communication_data_type(stage: int, precision: str, comm: str, steps: int) -> None:
    results = run_distributed_or_fail(comm_rank, WORLD, stage, precision, comm, steps, timeout=240)
    ref = reference_run(precision, steps)
    # Mixed-precision training keeps its own tolerance; fp32 training with low-precision reductions gets that precision's.
    tol = TOL[precision] if precision != "fp32" else TOL[comm]
    for result in results:
        assert result["engine_dtype"] == LOW[comm]
        for step, (loss, ref_loss) in enumerate(zip(result["losses"], ref["losses"])):
            assert abs(loss - ref_loss) <= tol["loss"] * abs(ref_loss), (step, loss, ref_loss)
        if stage >= 2:
            assert _dtypes(result, "backward", SCATTER) == {LOW[comm]}
            if stage == 3:
                assert _dtypes(result, "forward", GATHER) == {LOW[precision]}  # gathers move the compute copy
        else:
            assert result["eager"] == [str(LOW[comm])]
    for name, value in ref["params"].items():
        assert _rel(results[0]["params"][name], value) <= tol["param"], (name, _rel(results[0]["params"][name], value))


def test_communication_data_type_config() -> None:
    zero2 = {"zero_optimization": {"stage": 2}}
    specs = [inv.spec() for inv in pipeline_from_config(load_config({**zero2, "bf16": {"enabled": True}}))]
    assert specs[:2] == ["amp", "comm_dtype(bf16)"] and specs[2].startswith("zero")
    specs = [inv.spec() for inv in pipeline_from_config(load_config({**zero2, "fp16": {"enabled": True}, "communication_data_type": "FP32"}))]
    assert specs[:2] == ["amp(dtype=fp16)", "comm_dtype"]  # fp32 is the pass's default
    specs = [inv.spec() for inv in pipeline_from_config(load_config({**zero2, "communication_data_type": "fp16"}))]
    assert specs[0] == "comm_dtype(fp16)"
    specs = [inv.spec() for inv in pipeline_from_config(load_config({**zero2}))]
    assert not any(s.startswith("comm_dtype") for s in specs)  # fp32 training, fp32 gradients: nothing to do
    assert load_config({"communication_data_type": None}).sections["communication_data_type"] is None
    for bad in ("fp8", "float16", 16):
        with pytest.raises(DSCompileConfigError, match="communication_data_type.*fp32"):
            load_config({"communication_data_type": bad})
