"""Layer reduction and ``redundancy_clean``: exact copies, really smaller models, same outputs."""

from __future__ import annotations

import io
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dscompile.compression import get_compression_scheduler, init_compression, redundancy_clean
from dscompile.runtime.compression import QuantizedEmbedding, QuantizedLinear
from dscompile.zoo import build

transformers = pytest.importorskip("transformers")


def saved_bytes(model: nn.Module) -> int:
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.tell()


def compiled_output(model: nn.Module, cfg: dict, *inputs: Any, **kwargs: Any) -> torch.Tensor:
    model.eval()
    compiled = torch.compile(model, backend="dscompile", options=cfg)
    with torch.no_grad():
        out = compiled(*inputs, **kwargs)
    return out.logits if hasattr(out, "logits") else out


# --------------------------------------------------------------------------------------------
# layer reduction
# --------------------------------------------------------------------------------------------
def reduction(teacher_layer: list[int], prefix: str, others: list[str]) -> dict:
    return {
        "compression_training": {
            "layer_reduction": {
                "enabled": True,
                "keep_number_layer": len(teacher_layer),
                "module_name_prefix": prefix,
                "teacher_layer": teacher_layer,
                "other_module_name": others,
            }
        }
    }


def test_layer_reduction_copies_the_chosen_teacher_layers_exactly() -> None:
    teacher = build("bert", n_layers=4, seed=1).model
    student = build("bert", n_layers=2, seed=2).model
    others = ["tok_emb", "pos_emb", "emb_norm", "pooler", "classifier"]
    init_compression(student, reduction([1, 3], "layers", others), teacher_model=teacher)
    for s_index, t_index in enumerate([1, 3]):
        for (name, s_param), (_, t_param) in zip(student.layers[s_index].state_dict().items(), teacher.layers[t_index].state_dict().items()):
            assert torch.equal(s_param, t_param), name
    for name in others:
        for key, value in student.get_submodule(name).state_dict().items():
            assert torch.equal(value, teacher.get_submodule(name).state_dict()[key]), f"{name}.{key}"


def test_layer_reduction_without_teacher_drops_layers_of_the_model_itself() -> None:
    model = build("gpt", n_layers=4, seed=3).model
    original = [{k: v.clone() for k, v in block.state_dict().items()} for block in model.blocks]
    init_compression(model, reduction([0, 2], "blocks", []))
    assert len(model.blocks) == 2 and model.config.n_layers == 2
    for position, source in enumerate([0, 2]):
        for key, value in model.blocks[position].state_dict().items():
            assert torch.equal(value, original[source][key])
    assert sum(p.numel() for p in model.parameters()) < sum(v.numel() for block in original for v in block.values()) + 10**6
    logits = model(torch.randint(0, 128, (2, 16)))
    assert logits.shape == (2, 16, 128)


def test_layer_reduction_of_a_hugging_face_bert() -> None:
    config = transformers.BertConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64, max_position_embeddings=32
    )
    torch.manual_seed(0)
    teacher = transformers.BertForSequenceClassification(config)
    student = transformers.BertForSequenceClassification(transformers.BertConfig(**{**config.to_dict(), "num_hidden_layers": 4}))
    init_compression(student, reduction([0, 3], "bert.encoder.layer", ["bert.embeddings", "bert.pooler", "classifier"]), teacher_model=teacher)
    assert len(student.bert.encoder.layer) == 2 and student.config.num_hidden_layers == 2
    for key, value in student.bert.encoder.layer[1].state_dict().items():
        assert torch.equal(value, teacher.bert.encoder.layer[3].state_dict()[key])
    ids = torch.randint(0, 128, (2, 8))
    assert student(input_ids=ids).logits.shape == (2, 2)


# --------------------------------------------------------------------------------------------
# redundancy_clean: size and numerics
# --------------------------------------------------------------------------------------------
def hf_bert() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    config = transformers.BertConfig(
        vocab_size=1024, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512, max_position_embeddings=64, num_labels=3
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).eval()
    ids = torch.randint(0, 1024, (2, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 16:] = 0
    return model, {"input_ids": ids, "attention_mask": mask}


@pytest.mark.slow
@pytest.mark.parametrize("bits,limit", [(8, 0.30), (4, 0.17)])
def test_cleaned_hf_bert_is_small_and_equals_the_fake_quantized_model(bits: int, limit: float) -> None:
    model, inputs = hf_bert()
    fp32_bytes = saved_bytes(model)
    cfg = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "schedule_offset": 0, "quantize_groups": 64},
                "different_groups": {"all": {"params": {"start_bits": bits + 2, "target_bits": bits, "quantization_period": 1}, "modules": ["*"]}},
            }
        }
    }
    init_compression(model, cfg)
    get_compression_scheduler(model).step(10)  # the bit schedule has reached target_bits
    expected = compiled_output(model, cfg, **inputs)
    redundancy_clean(model, cfg)
    assert isinstance(model.bert.encoder.layer[0].intermediate.dense, QuantizedLinear)
    assert isinstance(model.bert.embeddings.word_embeddings, QuantizedEmbedding)
    cleaned_bytes = saved_bytes(model)
    assert cleaned_bytes <= limit * fp32_bytes, (cleaned_bytes, fp32_bytes)
    with torch.no_grad():
        out = model(**inputs).logits
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    if bits == 8:
        return
    # the cleaned model compiles through dscompile (the torch quantized-matmul path under Inductor)
    torch._dynamo.reset()
    with torch.no_grad():
        recompiled = torch.compile(model, backend="dscompile")(**inputs).logits
    torch.testing.assert_close(recompiled, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_cleaned_gpt_with_tied_embeddings_reloads_from_its_state_dict() -> None:
    cfg = {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {"enabled": True, "schedule_offset": 0, "quantize_weight_in_forward": True, "quantization_type": "asymmetric"},
                "different_groups": {"all": {"params": {"start_bits": 4, "target_bits": 4}, "modules": ["*"]}},
            },
            "activation_quantization": {
                "shared_parameters": {"enabled": True, "schedule_offset": 0},
                "different_groups": {"mlp": {"params": {"bits": 8}, "modules": [r"mlp\.fc"]}},
            },
        }
    }
    case = build("gpt", d_model=64, n_layers=2, vocab_size=256)
    model = case.model
    idx = case.example_inputs[0]
    init_compression(model, cfg)
    expected = compiled_output(model, cfg, idx)
    redundancy_clean(model, cfg)
    assert model.lm_head.embedding is model.wte  # the tied table is stored once
    with torch.no_grad():
        torch.testing.assert_close(model(idx), expected, rtol=1e-4, atol=1e-4)
    state = model.state_dict()
    fresh = build("gpt", d_model=64, n_layers=2, vocab_size=256, seed=5).model
    init_compression(fresh, cfg)
    redundancy_clean(fresh, cfg)
    fresh.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(fresh(idx), expected, rtol=1e-4, atol=1e-4)


def _pruning(technique: str, modules: list[str], related: list[list[str]], method: str = "l1", **shared: Any) -> dict:
    return {
        technique: {
            "shared_parameters": {"enabled": True, "schedule_offset": 0, "method": method, **shared},
            "different_groups": {"g": {"params": {"dense_ratio": 0.5}, "modules": modules, "related_modules": related}},
        }
    }


@pytest.mark.parametrize("method", ["l1", "topk"])
def test_row_and_head_pruning_shrink_the_model_and_keep_its_outputs(method: str, caplog: pytest.LogCaptureFixture) -> None:
    """The pruned rows and heads are physically removed; the attention's head count is left as it was
    (as DeepSpeed leaves it, and named in a warning; its BERT example sets it afterwards); the model's
    attention reads the count from the shapes, as Hugging Face's BERT does."""
    cfg = {
        "compression_training": {
            **_pruning("row_pruning", [r"layers\.\d+\.fc"], [[r"layers\.\d+\.out"]], method),
            **_pruning("head_pruning", [r"attn\.proj"], [[r"attn\.qkv"]], method, num_heads=4),
        }
    }
    case = build("bert", d_model=32, n_layers=2)
    model = case.model
    original = {k: v.clone() for k, v in model.state_dict().items()}
    init_compression(model, cfg)
    masks = {i: (model.layers[i].fc.ds_compression.mask("row").bool(), model.layers[i].attn.proj.ds_compression.mask("head").bool()) for i in range(2)}
    expected = compiled_output(model, cfg, *case.example_inputs)
    with caplog.at_level("WARNING", logger="dscompile.passes.redundancy_clean"):
        redundancy_clean(model, cfg)
    assert "layers.0.attn.n_heads = 4 (kept heads: 2)" in caplog.text
    for i, (rows, heads) in masks.items():
        layer = model.layers[i]
        assert layer.attn.n_heads == 4  # left alone, as DeepSpeed does
        assert layer.fc.out_features == 64 and layer.out.in_features == 64  # half of 4 * 32 rows, physically
        assert layer.attn.qkv.out_features == 3 * 16 and layer.attn.proj.in_features == 16
        assert torch.equal(layer.fc.weight, original[f"layers.{i}.fc.weight"][rows])  # the kept rows, untouched
        columns = heads.repeat_interleave(8)
        assert torch.equal(layer.attn.proj.weight, original[f"layers.{i}.attn.proj.weight"][:, columns])
        assert torch.equal(layer.attn.qkv.weight, original[f"layers.{i}.attn.qkv.weight"][columns.repeat(3)])
        if method == "l1":  # the lowest L1 rows and heads were removed
            fc = original[f"layers.{i}.fc.weight"].abs().sum(1)
            assert float(fc[~rows].max()) <= float(fc[rows].min())
            proj = original[f"layers.{i}.attn.proj.weight"].abs().reshape(32, 4, 8).sum((0, 2))
            assert float(proj[~heads].max()) <= float(proj[heads].min())
    with torch.no_grad():
        torch.testing.assert_close(model(*case.example_inputs), expected, rtol=1e-5, atol=1e-5)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 6, 3, padding=1)
        self.fc = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.relu(self.conv2(F.relu(self.conv1(x)))).mean((2, 3)))


def test_channel_pruning_removes_channels_and_their_consumers_inputs() -> None:
    cfg = {"compression_training": _pruning("channel_pruning", ["conv1"], [["conv2"]])}
    torch.manual_seed(0)
    model = ConvNet()
    x = torch.randn(2, 3, 8, 8)
    init_compression(model, cfg)
    keep = model.conv1.ds_compression.mask("channel").bool()
    conv2 = model.conv2.weight.detach().clone()
    expected = compiled_output(model, cfg, x)
    redundancy_clean(model, cfg)
    assert model.conv1.out_channels == 4 and model.conv2.in_channels == 4
    assert torch.equal(model.conv2.weight, conv2[:, keep])
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


def test_channel_pruning_shrinks_a_related_batch_norm() -> None:
    cfg = {"compression_training": _pruning("channel_pruning", [r"features\.0$"], [[r"features\.1$", r"features\.4$"]])}
    model = build("cnn").model.eval()
    stats = model.features[1].running_var.clone()
    init_compression(model, cfg)
    keep = model.features[0].ds_compression.mask("channel").bool()
    redundancy_clean(model, cfg)
    bn = model.features[1]
    assert bn.num_features == int(keep.sum()) == model.features[0].out_channels == model.features[4].in_channels
    assert torch.equal(bn.running_var, stats[keep])
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 10)


def test_cleaned_sizes_follow_the_bits() -> None:
    """int8 and packed int4 layers hold a quarter and an eighth of the fp32 weight bytes, plus scales."""
    for bits, fraction in ((8, 0.25), (4, 0.125)):
        cfg = {
            "compression_training": {
                "weight_quantization": {
                    "shared_parameters": {"enabled": True, "schedule_offset": 0, "quantize_weight_in_forward": True, "quantize_groups": 64},
                    "different_groups": {"g": {"params": {"start_bits": bits, "target_bits": bits}, "modules": ["fc"]}},
                }
            }
        }
        model = nn.Sequential()
        model.fc = nn.Linear(256, 64)
        init_compression(model, cfg)
        redundancy_clean(model, cfg)
        layer = model.fc
        assert layer.qweight.numel() * layer.qweight.element_size() == math.ceil(256 * 64 * 4 * fraction)
        assert layer.scales.shape == (64, 1) and layer.scales.dtype == torch.float32
