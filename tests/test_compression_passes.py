"""The ``quantize`` and ``prune`` graph passes against eager references, under the default lowering.

References are written with plain torch: the weights replaced by their fake-quantized / masked
values through ``torch.func.functional_call`` and a straight-through gradient, which is what
DeepSpeed's compressed layers compute in eager mode.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from dscompile.compression import get_compression_scheduler, init_compression
from dscompile.errors import DSCompileConfigError
from dscompile.kernels.quantize import activation_values, fake_quantize, straight_through


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.head = nn.Linear(16 + 4 * 16, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)  # (B, 16, 16)
        h = self.fc2(F.gelu(self.fc1(h)))
        img = self.conv(h[:, None, :4, :4].reshape(h.shape[0], 1, 4, 4))
        return self.head(torch.cat([h.mean(dim=1), img.flatten(1)], dim=-1))


def make(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


IDS = torch.randint(0, 20, (3, 16), generator=torch.Generator().manual_seed(1))


def section(**techniques: Any) -> dict:
    return {"compression_training": techniques}


def weight_quant(modules: list[str], start: int, target: int, period: int = 1, **shared: Any) -> dict:
    return {
        "shared_parameters": {"enabled": True, "schedule_offset": 0, **shared},
        "different_groups": {"wq": {"params": {"start_bits": start, "target_bits": target, "quantization_period": period}, "modules": modules}},
    }


def compile_(model: nn.Module, cfg: dict, **extra: Any) -> Any:
    return torch.compile(model, backend="dscompile", options={**cfg, **extra})


def run_reference(model: nn.Module, replaced: dict[str, torch.Tensor], *inputs: Any, hooks: dict[str, Any] | None = None) -> torch.Tensor:
    """``model`` with some parameters replaced (and some layer inputs transformed), in eager."""
    handles = []
    for name, fn in (hooks or {}).items():
        handles.append(model.get_submodule(name).register_forward_pre_hook(lambda m, args, fn=fn: (fn(args[0]), *args[1:])))
    try:
        params = {n: p for n, p in model.named_parameters()}
        params.update(replaced)
        return functional_call(model, params, inputs)
    finally:
        for h in handles:
            h.remove()


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def count_compiles(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    from dscompile import frontend

    calls = [0]
    original = frontend.GraphCompiler.compile

    def counting(self, gm, inputs):  # noqa: ANN001
        calls[0] += 1
        return original(self, gm, inputs)

    monkeypatch.setattr(frontend.GraphCompiler, "compile", counting)
    return calls


@pytest.mark.parametrize("symmetric", [True, False])
def test_weight_and_activation_quantization_match_eager_reference(symmetric: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    qtype = "symmetric" if symmetric else "asymmetric"
    cfg = section(
        weight_quantization=weight_quant(["embed", "fc", "conv"], 8, 4, period=2, quantize_groups=4, quantization_type=qtype),
        activation_quantization={
            "shared_parameters": {"enabled": True, "schedule_offset": 1, "quantization_type": qtype},
            "different_groups": {"aq": {"params": {"bits": 8}, "modules": ["fc2"]}},
        },
    )
    model, ref_model = make(), make()
    init_compression(model, cfg)
    scheduler = get_compression_scheduler(model)
    compiles = count_compiles(monkeypatch)
    compiled = compile_(model, cfg)
    for step, bits in [(0, 8), (1, 7), (2, 7), (3, 6), (7, 5)]:
        scheduler.step(step)
        assert scheduler.bits() == {"embed": bits, "fc1": bits, "fc2": bits, "conv": bits}
        model.zero_grad()
        ref_model.zero_grad()
        out = compiled(IDS)
        out.square().mean().backward()

        def q(name: str, groups: int = 4, bits: int = bits) -> torch.Tensor:
            w = dict(ref_model.named_parameters())[name]
            return straight_through(fake_quantize(w.detach(), bits, groups, symmetric), w)

        replaced = {"embed.weight": q("embed.weight", 20), "fc1.weight": q("fc1.weight"), "fc2.weight": q("fc2.weight"), "conv.weight": q("conv.weight")}
        hooks = {"fc2": lambda x: straight_through(activation_values(x.detach(), bits=8, symmetric=symmetric, per="token"), x)} if step >= 1 else {}
        expected = run_reference(ref_model, replaced, IDS, hooks=hooks)
        expected.square().mean().backward()
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        for name, grad in grads(ref_model).items():
            torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, rtol=1e-4, atol=1e-6, msg=name)
    assert compiles[0] == 1  # the bit schedule and the switches are graph inputs: no recompiles


def test_static_activation_range_calibrates_in_training_only() -> None:
    cfg = section(
        activation_quantization={
            "shared_parameters": {"enabled": True, "schedule_offset": 0, "range_calibration": "static"},
            "different_groups": {"aq": {"params": {"bits": 8}, "modules": ["fc1"]}},
        }
    )
    model = make()
    init_compression(model, cfg)
    compiled = compile_(model, cfg)
    value_range = model.fc1.ds_compression.aq_range
    inputs = model.embed(IDS).detach()
    compiled(IDS).sum().backward()
    lo, hi = float(inputs.min()), float(inputs.max())
    # the first batch initialises the range, then DeepSpeed's momentum update runs on the same batch
    torch.testing.assert_close(value_range, torch.tensor([lo, hi]) * 0.95 + torch.tensor([lo, hi]) * 0.05)
    compiled(2 * IDS % 20).sum().backward()
    moved = value_range.clone()
    assert not torch.equal(moved, torch.tensor([lo, hi]))
    with torch.no_grad():
        compiled(3 * IDS % 20)
    assert torch.equal(value_range, moved)  # frozen outside training


PRUNED_LAYERS = {"sparse": "head", "row": "fc1", "head": "fc2", "channel": "conv"}


def _unit_scores(short: str, weight: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's l1 scores: |w| per element, L1 norm per row / head (of input columns) / channel."""
    w = weight.detach().abs()
    if short == "sparse":
        return w.reshape(-1)
    if short == "head":
        return w.reshape(w.shape[0], 4, -1).sum((0, 2))
    return w.reshape(w.shape[0], -1).sum(1)


@pytest.mark.parametrize("method", ["l1", "topk"])
def test_pruning_masks_keep_the_dense_ratio_and_match_eager(method: str) -> None:
    ratio = 0.4
    techniques = {}
    for short, layer in PRUNED_LAYERS.items():
        extra = {"num_heads": 4} if short == "head" else {}
        techniques[f"{short}_pruning"] = {
            "shared_parameters": {"enabled": True, "schedule_offset": 0, "method": method, **extra},
            "different_groups": {"g": {"params": {"dense_ratio": ratio}, "modules": [f"^{layer}$"]}},
        }
    cfg = section(**techniques)
    model, ref_model = make(), make()
    init_compression(model, cfg)
    replaced: dict[str, torch.Tensor] = {}
    for short, layer in PRUNED_LAYERS.items():
        mask = getattr(model, layer).ds_compression.mask(short)
        weight = getattr(ref_model, layer).weight
        units = {"sparse": weight.numel(), "row": weight.shape[0], "head": 4, "channel": weight.shape[0]}[short]
        assert mask.numel() == units and int(mask.sum()) == math.ceil(ratio * units), short  # exactly the dense ratio
        if method == "l1":  # the lowest-scoring units are the pruned ones
            scores = _unit_scores(short, weight)
            assert float(scores[mask.reshape(-1) == 0].max()) <= float(scores[mask.reshape(-1) == 1].min()), short
        if short == "sparse":
            w_mask = mask
        elif short == "head":
            w_mask = mask.repeat_interleave(weight.shape[1] // 4).reshape(1, -1)
        else:
            w_mask = mask.reshape(-1, *([1] * (weight.dim() - 1)))
        replaced[f"{layer}.weight"] = weight * w_mask
        if short in ("row", "channel"):
            replaced[f"{layer}.bias"] = getattr(ref_model, layer).bias * mask
    compiled = compile_(model, cfg)
    out = compiled(IDS)
    out.square().mean().backward()
    expected = run_reference(ref_model, replaced, IDS)
    expected.square().mean().backward()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    for short, layer in PRUNED_LAYERS.items():
        torch.testing.assert_close(getattr(model, layer).weight.grad, getattr(ref_model, layer).weight.grad, rtol=1e-5, atol=1e-6)
        scores = getattr(getattr(model, layer).ds_compression, f"{short}_scores", None)
        if method == "topk":  # learned through the straight-through estimator
            assert scores is not None and scores.grad is not None and scores.grad.abs().sum() > 0, short


def test_pruning_switches_on_at_the_schedule_offset(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = section(
        row_pruning={
            "shared_parameters": {"enabled": True, "schedule_offset": 2},
            "different_groups": {"g": {"params": {"dense_ratio": 0.5}, "modules": ["fc1"]}},
        }
    )
    model, ref_model = make(), make()
    init_compression(model, cfg)
    scheduler = get_compression_scheduler(model)
    compiles = count_compiles(monkeypatch)
    compiled = compile_(model, cfg)
    with torch.no_grad():
        for step in range(4):
            scheduler.step(step)
            if step < 2:
                torch.testing.assert_close(compiled(IDS), ref_model(IDS), rtol=1e-5, atol=1e-6)
            else:
                mask = model.fc1.ds_compression.row_mask
                expected = run_reference(ref_model, {"fc1.weight": ref_model.fc1.weight * mask[:, None], "fc1.bias": ref_model.fc1.bias * mask}, IDS)
                torch.testing.assert_close(compiled(IDS), expected, rtol=1e-5, atol=1e-6)
    assert compiles[0] == 1


def test_snip_momentum_raises_sparsity_on_its_schedule() -> None:
    cfg = section(
        sparse_pruning={
            "shared_parameters": {
                "enabled": True,
                "method": "snip_momentum",
                "schedule_offset": 2,
                "schedule_offset_end": 6,
                "schedule_offset_stride": 2,
                "dense_ratio": 0.25,
                "block_pattern": "4x1",
                "excluded_modules": ["head", "conv"],
            }
        }
    )
    model = make()
    init_compression(model, cfg)
    assert sorted(s.layer_name for _, s in get_compression_scheduler(model).layers) == ["fc1", "fc2"]
    scheduler = get_compression_scheduler(model)
    compiled = compile_(model, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    density = []
    for step in range(8):
        scheduler.step(step)
        compiled(IDS).square().mean().backward()
        scheduler.after_backward()
        opt.step()
        opt.zero_grad()
        density.append(float(model.fc1.ds_compression.sparse_mask.mean()))
    # cubic schedule: sparsity 0.75 * (1 - (1 - p)^3) at p = 0, 1/2, 1 (steps 2, 4, 6), held after
    expected = [1, 1, 1, 1, 1 - 0.75 * (1 - 0.125), 1 - 0.75 * (1 - 0.125), 0.25, 0.25]
    assert density == pytest.approx(expected, abs=1 / 512)
    blocks = model.fc1.ds_compression.sparse_mask.reshape(8, 4, 16)
    assert torch.equal(blocks.amax(dim=1), blocks.amin(dim=1))  # whole 4x1 blocks


def test_fp16_mixed_quantize_blends_real_weights() -> None:
    cfg = section(weight_quantization=weight_quant(["fc1"], 8, 6, period=4, fp16_mixed_quantize={"enabled": True, "quantize_change_ratio": 0.25}))
    model, ref_model = make(), make()
    init_compression(model, cfg)
    scheduler = get_compression_scheduler(model)
    compiled = compile_(model, cfg)
    with torch.no_grad():
        for step, ratio in [(0, 0.75), (2, 0.25), (3, 1.0), (4, 0.75)]:
            scheduler.step(step)
            bits = scheduler.bits()["fc1"]
            w = ref_model.fc1.weight
            expected = run_reference(ref_model, {"fc1.weight": ratio * w + (1 - ratio) * fake_quantize(w, bits)}, IDS)
            torch.testing.assert_close(compiled(IDS), expected, rtol=1e-5, atol=1e-6)


def test_compression_composes_with_bf16_and_activation_checkpointing() -> None:
    cfg = section(
        weight_quantization=weight_quant(["fc", "head"], 8, 8),
        sparse_pruning={
            "shared_parameters": {"enabled": True, "schedule_offset": 0},
            "different_groups": {"g": {"params": {"dense_ratio": 0.5}, "modules": ["fc2"]}},
        },
    )
    model, ref_model = make(), make()
    init_compression(model, cfg)
    mask = model.fc2.ds_compression.sparse_mask

    def reference() -> dict[str, torch.Tensor]:
        p = dict(ref_model.named_parameters())
        ste = lambda name: straight_through(fake_quantize(p[name].detach(), 8), p[name])  # noqa: E731
        return {"fc1.weight": ste("fc1.weight"), "fc2.weight": ste("fc2.weight") * mask, "head.weight": ste("head.weight")}

    compiled = compile_(model, cfg, bf16={"enabled": True}, activation_checkpointing={"policy": "full"})
    out = compiled(IDS)
    out.float().square().mean().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = run_reference(ref_model, reference(), IDS)
    expected.float().square().mean().backward()
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(model.fc2.weight.grad, ref_model.fc2.weight.grad, rtol=5e-2, atol=5e-3)


@pytest.fixture
def one_rank_group() -> Any:
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_quantization_reads_zero3_gathered_weights(one_rank_group: Any) -> None:
    """Under ZeRO-3 the weight is the gathered shard; quantization groups span the full matrix."""
    from dscompile.runtime.compression import state_of
    from dscompile.runtime.zero_shard import shard_model

    cfg = section(weight_quantization=weight_quant(["fc", "conv"], 4, 4, quantize_groups=4))
    model, ref_model = make(), make()
    init_compression(model, cfg)
    init_compression(ref_model, cfg)
    sharded = shard_model(model, stage=3)
    # the engine's wiring will carry this onto its shards (see dscompile.compression's docs)
    for full, shard in zip(sharded.partition.full_params, sharded.partition.shards):
        if state_of(full) is not None:
            shard.ds_compression = state_of(full)
    compiled = compile_(sharded, cfg, zero_optimization={"stage": 3})
    reference = compile_(ref_model, cfg)
    loss, ref_loss = compiled(IDS).square().mean(), reference(IDS).square().mean()
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
    names = [layout.name for layout in sharded.partition.layouts]
    shard_grad = sharded.partition.shards[names.index("fc1.weight")].grad
    torch.testing.assert_close(shard_grad[: ref_model.fc1.weight.numel()], ref_model.fc1.weight.grad.reshape(-1), rtol=1e-6, atol=1e-7)


def test_config_without_init_compression_is_an_error() -> None:
    cfg = section(weight_quantization=weight_quant(["fc"], 8, 8))
    with pytest.raises(Exception, match="init_compression"):
        compile_(make(), cfg)(IDS)


def test_prepared_model_called_directly_runs_the_compressed_graph() -> None:
    """As DeepSpeed's swapped layers, the prepared model's own call is compressed: it runs through the
    same passes as a dscompile compile of the model."""
    cfg = section(weight_quantization=weight_quant(["fc"], 4, 4))
    model, ref_model = make(), make()
    init_compression(model, cfg)
    with torch.no_grad():
        direct = model(IDS)
        torch.testing.assert_close(direct, compile_(model, cfg)(IDS))
        assert not torch.allclose(direct, ref_model(IDS), atol=1e-4)
    with pytest.raises(DSCompileConfigError, match="already prepared"):
        init_compression(model, cfg)


ZERO_CFG = section(
    weight_quantization=weight_quant(["fc", "conv"], 4, 4, quantize_groups=4),
    activation_quantization={
        "shared_parameters": {"enabled": True, "schedule_offset": 0},
        "different_groups": {"aq": {"params": {"bits": 8}, "modules": ["fc2"]}},
    },
)


def zero3_rank(rank: int, world: int) -> dict[str, Any]:
    """ZeRO-3 on ``world`` ranks: the compressed model's loss and this rank's shard gradients."""
    from dscompile.runtime.compression import state_of
    from dscompile.runtime.zero_shard import shard_model

    model = make()
    init_compression(model, ZERO_CFG)
    sharded = shard_model(model, stage=3)
    for full, shard in zip(sharded.partition.full_params, sharded.partition.shards):
        if state_of(full) is not None:  # what the engine's wiring will do for its shards
            shard.ds_compression = state_of(full)
    loss = compile_(sharded, ZERO_CFG, zero_optimization={"stage": 3})(IDS).square().mean()
    loss.backward()
    names = [layout.name for layout in sharded.partition.layouts]
    return {"loss": loss.detach(), "grads": {n: s.grad.clone() for n, s in zip(names, sharded.partition.shards)}}


@pytest.mark.slow
@pytest.mark.distributed
def test_quantization_under_zero3_on_two_ranks_matches_one_process() -> None:
    from dscompile.runtime.zero_shard import shard_of
    from dscompile.testing.distributed import run_distributed_or_fail

    results = run_distributed_or_fail(zero3_rank, 2, timeout=600)
    reference = make()
    init_compression(reference, ZERO_CFG)
    loss = compile_(reference, ZERO_CFG)(IDS).square().mean()
    loss.backward()
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["loss"], loss.detach(), rtol=1e-5, atol=1e-6)
        for name, param in reference.named_parameters():
            if name in result["grads"]:
                torch.testing.assert_close(result["grads"][name], shard_of(param.grad, rank, 2), rtol=1e-4, atol=1e-6, msg=name)
