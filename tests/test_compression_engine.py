"""Compression training through ``dscompile.initialize``: the engine prepares the model, the schedule
follows the optimizer steps (checked by reading the weight the compiled graph really uses, under the
default Inductor lowering), checkpoints resume it, ZeRO composes, and unsupported mixes are refused."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dscompile
from dscompile.compression import get_compression_scheduler, init_compression
from dscompile.errors import DSCompileConfigError
from dscompile.zoo import build

GROUPS = 4


def ds_symmetric(w: torch.Tensor, bits: int, groups: int = GROUPS) -> torch.Tensor:
    """DeepSpeed's symmetric group-wise quantizer (nearest rounding), in plain torch."""
    levels = 2**bits
    flat = w.reshape(groups, -1)
    scale = 2 * flat.abs().amax(dim=1, keepdim=True) / levels
    return ((flat / scale).round().clamp(-levels // 2, levels // 2 - 1) * scale).reshape(w.shape)


def effective_bits(seen: torch.Tensor, master: torch.Tensor, candidates: range = range(1, 9)) -> int | None:
    """The bit width whose quantization of ``master`` equals the weight the graph computed with
    (None: the unquantized weight); fails when no width or more than one matches."""
    matches = [None] if torch.equal(seen, master) else []
    matches += [b for b in candidates if torch.allclose(seen, ds_symmetric(master, b), rtol=0, atol=1e-7)]
    assert len(matches) == 1, f"the graph's weight matches bit widths {matches}"
    return matches[0]


class Probed(nn.Module):
    """The model's loss, plus one layer's weight as the compiled graph sees it: ``I @ W^T`` reads the
    weight through the same graph input the model's own layer reads, so it carries the same
    compression, and multiplying by the identity is exact."""

    def __init__(self, model: nn.Module, path: str) -> None:
        super().__init__()
        self.model = model
        self.path = path.split(".")
        self.register_buffer("eye", torch.eye(self.weight().shape[1]))

    def weight(self) -> torch.Tensor:
        return functools.reduce(getattr, self.path, self.model).weight

    def forward(self, *inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model(*inputs), F.linear(self.eye, self.weight()).t()


def count_compiles(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    from dscompile import frontend

    compiles = [0]
    original = frontend.GraphCompiler.compile

    def counting(self: Any, gm: Any, inputs: Any) -> Any:
        compiles[0] += 1
        return original(self, gm, inputs)

    monkeypatch.setattr(frontend.GraphCompiler, "compile", counting)
    return compiles


def wq_section(modules: list[str], offset: int, start: int, target: int, period: int) -> dict:
    return {
        "weight_quantization": {
            "shared_parameters": {"enabled": True, "schedule_offset": offset, "quantize_groups": GROUPS},
            "different_groups": {"wq": {"params": {"start_bits": start, "target_bits": target, "quantization_period": period}, "modules": modules}},
        }
    }


def config(section: dict, lr: float = 3e-3, **extra: Any) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": lr}}, "compression_training": section, **extra}


def train(engine: Any, batch: tuple, steps: int) -> list[tuple[float, torch.Tensor, torch.Tensor]]:
    """``steps`` optimizer steps; per step the loss, the master weight before it and the graph's weight."""
    out = []
    for _ in range(steps):
        master = engine.module.weight().detach().clone()
        loss, seen = engine(*batch)
        engine.backward(loss)
        engine.step()
        out.append((float(loss.detach()), master, seen.detach()))
    return out


# DeepSpeed's MoQ from schedule_offset 2, period 2: k = step - 1 quantizations, a bit dropped at k = 2, 4, 8
MOQ_BITS = [None, None, 8, 7, 7, 6, 6, 6, 6, 5, 5, 5]


@pytest.mark.slow
@pytest.mark.parametrize("name,layer", [("bert", "layers.0.fc"), ("gpt", "blocks.0.mlp.fc")])
def test_qat_through_initialize_follows_the_bit_schedule(name: str, layer: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine prepares the model itself and the graph's weight has the scheduled bits at each step."""
    compiles = count_compiles(monkeypatch)
    case = build(name, d_model=32, n_layers=2)
    engine, *_ = dscompile.initialize(model=Probed(case.model, layer), config=config(wq_section([r"layers|blocks"], 2, 8, 5, 2)))
    scheduler = get_compression_scheduler(engine.module)  # the engine called init_compression
    assert engine.extension("compression").prepared_by_engine
    records = train(engine, (*case.example_inputs, case.targets), len(MOQ_BITS))
    assert [effective_bits(seen, master) for _, master, seen in records] == MOQ_BITS
    assert scheduler.global_step == len(MOQ_BITS)
    losses = [loss for loss, _, _ in records]
    assert losses[-1] < 0.8 * losses[0], losses
    assert compiles[0] == 1  # every bit change was read from the state tensors, no recompile


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.fc2(torch.relu(self.fc1(x))), y)


def mlp_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)


def probed_mlp(seed: int = 0) -> Probed:
    torch.manual_seed(seed)
    return Probed(MLP(), "fc1")


def test_sparse_pruning_mask_applies_from_its_schedule_offset() -> None:
    section = {
        "sparse_pruning": {
            "shared_parameters": {"enabled": True, "method": "l1", "schedule_offset": 3},
            "different_groups": {"sp": {"params": {"dense_ratio": 0.25}, "modules": ["fc1"]}},
        }
    }
    engine, *_ = dscompile.initialize(model=probed_mlp(), config=config(section, lr=1e-2))
    records = train(engine, mlp_batch(), 6)
    for step, (_, master, seen) in enumerate(records):
        if step < 3:
            torch.testing.assert_close(seen, master, rtol=0, atol=0, msg=f"step {step} is masked before schedule_offset")
        else:
            assert int((seen == 0).sum()) == master.numel() // 4 * 3, step  # exactly the dense ratio kept
            kept = seen != 0
            torch.testing.assert_close(seen[kept], master[kept], rtol=0, atol=0)
            # as in DeepSpeed, l1 masks are decided from the weights init_compression saw (the engine's here)
            decided_at = records[0][1]
            threshold = decided_at.abs().flatten().kthvalue(master.numel() - master.numel() // 4).values
            assert torch.equal(kept, decided_at.abs() > threshold), step


def test_checkpoint_resume_continues_the_schedule(tmp_path: Any) -> None:
    cfg = config(wq_section(["fc1", "fc2"], 1, 8, 4, 1))  # MoQ, period 1: bits at steps 0..8: None 7 6 6 5 5 5 5 4
    batch = mlp_batch()
    engine, *_ = dscompile.initialize(model=probed_mlp(), config=cfg)
    train(engine, batch, 3)
    engine.save_checkpoint(tmp_path, tag="s3")
    straight = train(engine, batch, 4)

    resumed, *_ = dscompile.initialize(model=probed_mlp(seed=5), config=cfg)
    scheduler = get_compression_scheduler(resumed.module)
    assert scheduler.bits()["model.fc1"] is None  # a fresh run starts before schedule_offset
    resumed.load_checkpoint(tmp_path, tag="s3")
    assert resumed.extension("compression").applied_steps == 3
    assert scheduler.bits()["model.fc1"] == 6
    after = train(resumed, batch, 4)
    assert [effective_bits(seen, master) for _, master, seen in after] == [6, 5, 5, 5]
    for (loss, _, seen), (ref_loss, _, ref_seen) in zip(after, straight):
        assert loss == pytest.approx(ref_loss, rel=1e-6)
        torch.testing.assert_close(seen, ref_seen, rtol=0, atol=0)


def test_a_script_prepared_model_trains_as_an_engine_prepared_one() -> None:
    cfg = config(wq_section(["fc1"], 0, 6, 4, 2))
    batch = mlp_batch()
    ours = probed_mlp()
    init_compression(ours, cfg)  # DeepSpeed's order: init_compression, then initialize
    engine, *_ = dscompile.initialize(model=ours, config=cfg)
    assert not engine.extension("compression").prepared_by_engine
    by_engine, *_ = dscompile.initialize(model=probed_mlp(), config=cfg)
    a, b = train(engine, batch, 4), train(by_engine, batch, 4)
    assert [effective_bits(seen, master) for _, master, seen in a] == [6, 5, 5, 4]  # MoQ from step 0, period 2: drops at k = 2, 4
    for (loss, _, seen), (ref_loss, _, ref_seen) in zip(a, b):
        assert loss == ref_loss
        assert torch.equal(seen, ref_seen)


def test_learned_topk_scores_join_the_optimizer() -> None:
    section = {
        "row_pruning": {
            "shared_parameters": {"enabled": True, "method": "topk", "schedule_offset": 0},
            "different_groups": {"rp": {"params": {"dense_ratio": 0.5}, "modules": ["fc1"], "related_modules": [["fc2"]]}},
        }
    }
    engine, optimizer, *_ = dscompile.initialize(model=probed_mlp(), config=config(section, lr=1e-2))
    scores = engine.module.model.fc1.ds_compression.row_scores
    assert any(p is scores for group in optimizer.param_groups for p in group["params"])
    before = scores.detach().clone()
    (_, master, seen), *_ = train(engine, mlp_batch(), 2)
    assert int((seen.abs().sum(dim=1) == 0).sum()) == 16  # half of fc1's 32 rows masked
    assert not torch.equal(scores.detach(), before)  # the straight-through gradient trained them


def test_zero3_qat_through_initialize_equals_the_unsharded_run() -> None:
    """Without a process group ZeRO-3 runs at world size 1: the graphs read gathered shards, which the
    engine links to the layers' compression state."""
    cfg = config(wq_section(["fc1", "fc2"], 1, 8, 6, 1))
    batch = mlp_batch()
    plain, *_ = dscompile.initialize(model=probed_mlp(), config=cfg)
    zero3, *_ = dscompile.initialize(model=probed_mlp(), config={**cfg, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    expected = train(plain, batch, 4)
    for step in range(4):
        loss, seen = zero3(*batch)
        zero3.backward(loss)
        zero3.step()
        assert float(loss.detach()) == pytest.approx(expected[step][0], rel=1e-5), step
        torch.testing.assert_close(seen.detach(), expected[step][2], rtol=1e-5, atol=1e-6)
    assert [effective_bits(seen, master) for _, master, seen in expected] == [None, 7, 6, 6]


@pytest.mark.parametrize(
    "method,stage,key",
    [("topk", 2, "sparse_pruning"), ("snip_momentum", 1, "sparse_pruning"), ("l1", 3, "sparse_pruning")],
)
def test_pruning_that_zero_would_silently_break_is_refused(method: str, stage: int, key: str) -> None:
    shared: dict[str, Any] = {"enabled": True, "method": method, "schedule_offset": 0}
    if method == "snip_momentum":
        shared.update(block_pattern="4x1", dense_ratio=0.5, schedule_offset_end=4)
    section = {"sparse_pruning": {"shared_parameters": shared, "different_groups": {"sp": {"params": {"dense_ratio": 0.5}, "modules": ["fc1"]}}}}
    with pytest.raises(DSCompileConfigError, match=rf"{key}\.shared_parameters\.method.*ZeRO stage {stage}"):
        dscompile.initialize(model=MLP(), config=config(section, zero_optimization={"stage": stage}))


def test_compression_with_pipeline_parallelism_is_refused() -> None:
    from dscompile.config import load_config
    from dscompile.engines.pipeline_parallel import PipelineEngine

    cfg = load_config(config(wq_section(["fc1"], 0, 8, 8, 1), pipeline={"stages": 1}))
    with pytest.raises(DSCompileConfigError, match="compression_training.*pipeline"):
        PipelineEngine(MLP(), cfg, torch.optim.Adam(MLP().parameters()))


def test_a_reused_graph_reads_each_instance_own_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dynamo reuses one compiled graph for two instances of a model class (parameters are inputs):
    each call must read the compression state of its own instance, not the first one's."""
    compiles = count_compiles(monkeypatch)
    cfg = {"compression_training": wq_section(["fc1"], 0, 8, 4, 1)}  # MoQ from step 0: 7 bits at step 0, 4 from step 7
    first, second = probed_mlp(), probed_mlp(seed=1)
    for model in (first, second):
        init_compression(model, cfg)
    get_compression_scheduler(first).step(7)
    batch = mlp_batch()
    seen_first = torch.compile(first, backend="dscompile", options=cfg)(*batch)[1]
    seen_second = torch.compile(second, backend="dscompile", options=cfg)(*batch)[1]
    assert compiles[0] == 1
    assert effective_bits(seen_first.detach(), first.weight().detach()) == 4
    assert effective_bits(seen_second.detach(), second.weight().detach()) == 7


ZERO3_CFG = config(wq_section(["fc1", "fc2"], 1, 8, 6, 1), zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0})


def zero3_qat_rank(rank: int, world: int) -> dict[str, Any]:
    """ZeRO-3 QAT through initialize on ``world`` ranks, each on its slice of the batch."""
    x, y = mlp_batch()
    rows = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
    engine, *_ = dscompile.initialize(model=probed_mlp(), config=ZERO3_CFG)
    records = []
    for _ in range(4):
        loss, seen = engine(x[rows], y[rows])
        engine.backward(loss)
        engine.step()
        records.append((loss.detach(), seen.detach()))
    return {"records": records, "params": {k: v.detach().clone() for k, v in engine.full_parameters().items()}}


@pytest.mark.slow
@pytest.mark.distributed
def test_zero3_qat_through_initialize_on_two_ranks_matches_one_process() -> None:
    from dscompile.testing.distributed import run_distributed_or_fail

    results = run_distributed_or_fail(zero3_qat_rank, 2, timeout=600)
    plain_cfg = {k: v for k, v in ZERO3_CFG.items() if k != "zero_optimization"}
    reference, *_ = dscompile.initialize(model=probed_mlp(), config=plain_cfg)
    expected = train(reference, mlp_batch(), 4)
    assert [effective_bits(seen, master) for _, master, seen in expected] == [None, 7, 6, 6]
    for step, (loss, _, seen) in enumerate(expected):
        mean = sum(float(r["records"][step][0]) for r in results) / len(results)
        assert mean == pytest.approx(loss, rel=1e-5), step
        for r in results:
            torch.testing.assert_close(r["records"][step][1], seen, rtol=1e-5, atol=1e-6)
    for name, value in reference.module.named_parameters():
        for r in results:
            torch.testing.assert_close(r["params"][name], value.detach(), rtol=1e-5, atol=1e-6, msg=name)


class HFClassifier(nn.Module):
    """A Hugging Face BERT classifier built from a config, returning its loss."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        config = transformers.BertConfig(
            vocab_size=256,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=32,
            num_labels=3,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        torch.manual_seed(0)
        self.bert = transformers.BertForSequenceClassification(config)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=ids, labels=labels).loss


@pytest.mark.slow
def test_qat_of_a_hugging_face_bert_through_initialize() -> None:
    pytest.importorskip("transformers")
    section = wq_section([r"encoder\.layer\.\d+\.(intermediate|output)\.dense"], 1, 8, 6, 2)
    engine, *_ = dscompile.initialize(model=Probed(HFClassifier(), "bert.bert.encoder.layer.0.intermediate.dense"), config=config(section, lr=1e-3))
    g = torch.Generator().manual_seed(2)
    batch = (torch.randint(0, 256, (4, 16), generator=g), torch.randint(0, 3, (4,), generator=g))
    records = train(engine, batch, 6)
    assert [effective_bits(seen, master) for _, master, seen in records] == [None, 8, 7, 7, 6, 6]  # MoQ from step 1, period 2
    losses = [loss for loss, _, _ in records]
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.9 * losses[0], losses


def test_a_skipped_step_does_not_advance_the_schedule() -> None:
    """DeepSpeed counts applied optimizer steps only: the hook the core calls after an fp16 overflow
    leaves the schedule where it was."""
    engine, *_ = dscompile.initialize(model=probed_mlp(), config=config(wq_section(["fc1"], 0, 8, 4, 1)))
    extension, scheduler = engine.extension("compression"), get_compression_scheduler(engine.module)
    assert scheduler.bits()["model.fc1"] == 7
    extension.after_optimizer_step(engine, True)
    assert (extension.applied_steps, scheduler.bits()["model.fc1"]) == (0, 7)
    extension.after_optimizer_step(engine, False)
    assert (extension.applied_steps, scheduler.bits()["model.fc1"]) == (1, 6)
