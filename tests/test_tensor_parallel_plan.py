"""Tensor parallelism without ranks: the config section, the TP × DP × PP layout, and what the pass finds.

The numerics across ranks are in ``test_tensor_parallel.py``; here the graph analysis runs on one
process (``find_blocks`` needs no process group) so its decisions and refusals are checked directly.
"""

from __future__ import annotations

import pytest
import torch

from dscompile.config import load_config
from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError
from dscompile.passes.tensor_parallel import LayerSpec, PartitionConfig, apply_layer_specs, capture, check_layer_specs, find_blocks
from dscompile.runtime.process_groups import ParallelLayout
from dscompile.runtime.tensor_parallel import SliceSpec
from dscompile.zoo import build, make_batch


def test_config_section() -> None:
    tc = load_config({"tensor_parallel": {"autotp_size": 2}}).sections["tensor_parallel"]
    assert tc.enabled and tc.autotp_size == 2
    assert load_config({"tensor_parallel": {"tp": {"tp_size": 4}}}).sections["tensor_parallel"].autotp_size == 4
    assert load_config({"tensor_parallel": {"autotp_size": 2, "vocab_parallel_ce_backend": "torch"}}).sections["tensor_parallel"].enabled  # DeepSpeed's default
    assert not load_config({"tensor_parallel": {"autotp_size": 0, "tp": {"tp_size": 1, "tp_grain_size": 1}}}).sections["tensor_parallel"].enabled
    with pytest.raises(DSCompileConfigError, match="contradicts"):
        load_config({"tensor_parallel": {"autotp_size": 2, "tp": {"tp_size": 4}}})
    with pytest.raises(DSCompileConfigError) as info:
        load_config({"tensor_parallel": {"autotp_size": 2, "partition_config": {"layer_specs": [{"patterns": ["x"], "partition_type": "diagonal"}]}}})
    assert info.value.key.endswith("partition_type")


def _specs(*specs: dict) -> PartitionConfig:
    section = {"autotp_size": 2, "partition_config": {"use_default_specs": False, "layer_specs": list(specs)}}
    return load_config({"tensor_parallel": section}).sections["tensor_parallel"].partition_config


def test_deepspeed_layer_spec_fields_are_checked_against_the_split() -> None:
    """DeepSpeed 0.19's TPLayerSpec fields load; what they state must agree with the split the graph made."""
    qkv = {"patterns": [r".*qkv_proj\.weight$"], "partition_type": "column", "shape": [[4, 2, 2], -1], "partition_dim": 0}
    norm = {"patterns": [r".*q_norm\.weight$"], "partition_type": "skip", "grad_allreduce": True}
    pc = _specs(qkv, norm, {"patterns": ["o_proj"], "partition_type": "row", "model_types": ["phi3"]})
    slices = {"qkv_proj.weight": SliceSpec(dim=0, sections=(4, 2, 2)), "o_proj.weight": SliceSpec(dim=1)}
    check_layer_specs(slices, {"q_norm.weight"}, pc, ["qkv_proj.weight", "q_norm.weight", "o_proj.weight"], "phi3")
    with pytest.raises(DSCompileConfigError, match="parts"):  # the graph cut it in three equal parts
        check_layer_specs({"qkv_proj.weight": SliceSpec(dim=0, blocks=3)}, set(), pc, ["qkv_proj.weight"], None)
    assert check_layer_specs({"qkv_proj.weight": SliceSpec(dim=0, blocks=3)}, set(), _specs({**qkv, "shape": [3, -1]}), ["qkv_proj.weight"], None) is None
    # a Python config (DeepSpeedExamples' custom_patterns) writes the shape as tuples: the same spec
    check_layer_specs(slices, {"q_norm.weight"}, _specs({**qkv, "shape": ((4, 2, 2), -1)}, norm), ["qkv_proj.weight", "q_norm.weight"], None)
    with pytest.raises(DSCompileConfigError, match="every rank computes all of it"):
        check_layer_specs({}, set(), pc, ["q_norm.weight"], None)
    with pytest.raises(DSCompileConfigError, match="along dim 1"):
        check_layer_specs({"qkv_proj.weight": SliceSpec(dim=0)}, set(), _specs({**qkv, "shape": None, "partition_dim": 1}), ["qkv_proj.weight"], None)
    # model_types: a spec for another model does not apply
    assert apply_layer_specs([], [], _specs({"patterns": ["w"], "partition_type": "row", "model_types": ["llama"]}), ["w"], "gpt2") == []
    with pytest.raises(DSCompileConfigError, match="row-parallel"):
        apply_layer_specs([], [], _specs({"patterns": ["w"], "partition_type": "row", "model_types": ["llama"]}), ["w"], "llama")
    with pytest.raises(DSCompileNotSupportedError) as info:
        _specs({"patterns": ["lm_head"], "gather_output": True})
    assert info.value.key.endswith("gather_output")
    with pytest.raises(DSCompileNotSupportedError):
        _specs({"patterns": ["w1"], "shape": [8, -1, 16], "partition_dim": 1})  # MoE's 3-D view
    with pytest.raises(DSCompileConfigError, match="skip specs only"):
        _specs({"patterns": ["w"], "partition_type": "column", "grad_allreduce": True})


def test_layout_is_megatron_order() -> None:
    layout = ParallelLayout(world_size=8, tp_size=2, pp_size=2)
    assert layout.dp_size == 2
    assert layout.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]  # TP innermost: consecutive ranks
    assert layout.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.coordinates(5) == (1, 0, 1)
    with pytest.raises(DSCompileConfigError):
        ParallelLayout(world_size=6, tp_size=4)


def test_fused_slices_round_trip() -> None:
    full = torch.arange(24.0).reshape(12, 2)
    spec = SliceSpec(dim=0, blocks=3)  # q, k, v of 4 rows each, split in 2
    parts = [spec.take(full, r, 2) for r in range(2)]
    assert parts[0][:, 0].tolist() == [0.0, 2.0, 8.0, 10.0, 16.0, 18.0]
    assert torch.equal(spec.assemble(parts), full)


def test_unequal_fused_parts_round_trip() -> None:
    full = torch.arange(8.0).reshape(8, 1)  # a fused q (4 rows), k (2) and v (2) under GQA, on TP=2
    spec = SliceSpec(dim=0, sections=(4, 2, 2))
    parts = [spec.take(full, r, 2) for r in range(2)]
    assert parts[0][:, 0].tolist() == [0, 1, 4, 6] and parts[1][:, 0].tolist() == [2, 3, 5, 7]  # each rank: half of q, of k, of v
    assert torch.equal(spec.assemble(parts), full)
    assert SliceSpec.from_dict(spec.to_dict()) == spec  # as checkpoint metadata keeps it
    assert SliceSpec.from_dict({"dim": 1, "blocks": 3}) == SliceSpec(dim=1, blocks=3)  # files written before the newer fields


def _blocks(name: str, tp: int, **overrides):
    case = build(name, seed=0, **overrides)
    gm = capture(case.model, make_batch(case, seed=0), {})
    return find_blocks(gm, tp)


@pytest.fixture(scope="module")
def gpt_blocks():
    return _blocks("gpt", 2, seq_len=8, d_model=16, n_heads=2, n_layers=1, vocab_size=40)


def test_finds_attention_and_mlp_blocks(gpt_blocks) -> None:
    blocks, whole = gpt_blocks
    assert whole == []
    roles = sorted((tuple(c.weight for c in b.columns), b.row.weight) for b in blocks)
    assert roles == [(("blocks.0.attn.qkv.weight",), "blocks.0.attn.proj.weight"), (("blocks.0.mlp.fc.weight",), "blocks.0.mlp.proj.weight")]
    attention = next(b for b in blocks if "attn" in b.row.weight)
    assert attention.blocks[attention.columns[0].node] == 3  # the fused qkv is split part by part


def test_heads_not_divisible_are_padded() -> None:
    blocks, whole = _blocks("gpt", 4, seq_len=8, d_model=24, n_heads=6, n_layers=1, vocab_size=40)
    assert whole == []
    units = {b.row.weight: b.units for b in blocks}
    assert units == {"blocks.0.attn.proj.weight": 6, "blocks.0.mlp.proj.weight": 96}  # 6 heads: padded to 8 on TP=4


def test_padded_slices_round_trip() -> None:
    full = torch.arange(18.0).reshape(18, 1)  # a fused q, k, v of 3 heads of 2 rows each, on TP=2
    spec = SliceSpec(dim=0, blocks=3, units=3)
    parts = [spec.take(full, r, 2) for r in range(2)]
    assert parts[0][:, 0].tolist() == [0, 1, 2, 3, 6, 7, 8, 9, 12, 13, 14, 15]  # heads 0 and 1 of q, k and v
    assert parts[1][:, 0].tolist() == [4, 5, 0, 0, 10, 11, 0, 0, 16, 17, 0, 0]  # head 2, then a zero head
    assert torch.equal(spec.assemble(parts), full)


def test_layer_specs_override_and_refuse_contradictions(gpt_blocks) -> None:
    blocks, _ = gpt_blocks
    whole: list = []
    names = [c.weight for b in blocks for c in b.columns] + [b.row.weight for b in blocks]
    skip = PartitionConfig(layer_specs=[LayerSpec([r"mlp\.fc"], "skip")])
    kept = apply_layer_specs(list(blocks), whole, skip, names)
    assert [b.row.weight for b in kept] == ["blocks.0.attn.proj.weight"]
    wrong = PartitionConfig(layer_specs=[LayerSpec([r"attn\.proj\.weight"], "column")])
    with pytest.raises(DSCompileConfigError, match="column-parallel"):
        apply_layer_specs(list(blocks), [], wrong, names)
    only = PartitionConfig(use_default_specs=False, layer_specs=[LayerSpec([r"mlp\.fc"], "column"), LayerSpec([r"mlp\.proj"], "row")])
    assert [b.row.weight for b in apply_layer_specs(list(blocks), [], only, names)] == ["blocks.0.mlp.proj.weight"]


def test_plain_compile_refuses_tensor_parallel() -> None:
    compiled = torch.compile(torch.nn.Linear(2, 2), backend="dscompile", options={"tensor_parallel": {"autotp_size": 2}})
    with pytest.raises(Exception, match="only an engine can own"):
        compiled(torch.ones(2))


def test_hugging_face_training_cache_neither_breaks_capture_nor_keeps_blocks_whole() -> None:
    """Hugging Face GPT-2 builds a KV cache in training mode (keys joined to an empty tensor) and returns it:
    captured with ``use_cache`` off by default (export cannot return the cache object), and with an explicit
    ``use_cache=True`` the join with the empty tensor keeps each block splittable."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16)
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 50, (2, 8))
    gm = capture(model, (), {"input_ids": ids, "labels": ids})
    assert model.config.use_cache is True  # restored after the capture
    blocks, whole = find_blocks(gm, 2)
    assert len(blocks) == 4 and not whole, whole

    class ReturnsLoss(torch.nn.Module):  # the cache is built (and dropped) inside: its joins stay in the graph
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=ids, labels=ids, use_cache=True).loss

    gm = capture(ReturnsLoss(), (ids,), {})
    assert any(n.target is torch.ops.aten.cat.default for n in gm.graph.nodes)
    blocks, whole = find_blocks(gm, 2)
    assert len(blocks) == 4 and not whole, whole


HF_LAYOUTS = {  # architecture -> (config class, model class, config fields): what each needs the pass to know
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"num_key_value_heads": 2, "head_dim": 8}),  # a norm between each block and its residual add
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"num_key_value_heads": 2, "head_dim": 8}),  # that, and per-head q/k norms
    "gptj": ("GPTJConfig", "GPTJForCausalLM", {"n_layer": 2, "n_embd": 32, "n_head": 4, "rotary_dim": 4}),  # interleaved rotary: stack + flatten
    "cohere": ("CohereConfig", "CohereForCausalLM", {"num_key_value_heads": 2}),  # the same rotary
}


@pytest.mark.parametrize("arch", sorted(HF_LAYOUTS))
def test_hugging_face_layouts_split_every_block(arch: str) -> None:
    """Post-norms, per-head norms and interleaved rotary keep every attention and MLP block splittable
    (their numerics on 2 ranks: ``test_model_parallel_hf_calls.py`` for Gemma2, Qwen3 and Phi-3)."""
    transformers = pytest.importorskip("transformers")
    config_name, model_name, fields = HF_LAYOUTS[arch]
    if not hasattr(transformers, config_name):
        pytest.skip(f"transformers {transformers.__version__} has no {config_name}")
    torch.manual_seed(0)
    common = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 64, "max_position_embeddings": 32}
    config = getattr(transformers, config_name)(**{**common, **fields})
    model = getattr(transformers, model_name)(config).train()
    ids = torch.randint(0, 64, (2, 8))
    blocks, whole = find_blocks(capture(model, (), {"input_ids": ids, "labels": ids}), 2)
    assert len(blocks) == 4 and not whole, whole


def _encoder_decoder(arch: str, heads: int = 4) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if arch == "t5":
        config = transformers.T5Config(vocab_size=40, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=heads, decoder_start_token_id=0)
        model = transformers.T5ForConditionalGeneration(config)
    else:
        config = transformers.BartConfig(
            vocab_size=40, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
        )  # fmt: skip
        model = transformers.BartForConditionalGeneration(config)
    return model.eval(), {"input_ids": torch.randint(3, 40, (2, 6)), "decoder_input_ids": torch.randint(3, 40, (2, 3)), "use_cache": False}


@pytest.mark.parametrize("arch", ["t5", "bart"])
def test_encoder_decoder_blocks_split(arch: str) -> None:
    """T5 and BART: every attention (the cross-attention too: its query reads the decoder, its keys and values the
    encoder) and MLP block splits; T5's relative position bias (one row per head, SDPA's mask) is cut to the rank's
    heads; BART's LM head plus ``final_logits_bias`` is no residual block (numerics on 2 ranks:
    ``test_inference_tensor_parallel.py``, ``test_deepspeed_scripts_inference.py``)."""
    model, inputs = _encoder_decoder(arch)
    blocks, whole = find_blocks(capture(model, (), inputs), 2)
    assert len(blocks) == 10 and not whole, whole  # encoder 2 x (attention, MLP), decoder 2 x (self, cross, MLP)
    cross = [b for b in blocks if len({c.input for c in b.columns}) == 2]
    assert len(cross) == 2 and all("EncDecAttention" in b.row.weight or "encoder_attn" in b.row.weight for b in cross)
    narrowed = [b for b in blocks if b.narrowed]
    assert len(narrowed) == (6 if arch == "t5" else 0), [b.row.weight for b in narrowed]  # every T5 attention reads the bias
    assert all(op.target is torch.ops.aten.scaled_dot_product_attention.default and dim == 1 for b in narrowed for op, _, dim in b.narrowed)


def test_position_bias_of_padded_heads_is_refused() -> None:
    """3 heads on TP=2 would be padded: a whole per-head bias cannot be cut to a rank's padded heads, so those
    attention blocks stay whole, with the reason."""
    model, inputs = _encoder_decoder("t5", heads=3)
    blocks, whole = find_blocks(capture(model, (), inputs), 2)
    assert len(whole) == 6 and all("a whole tensor per head" in w["reason"] for w in whole), whole
    assert len(blocks) == 4  # the MLPs
