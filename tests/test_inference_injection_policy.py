"""``init_inference(injection_policy=...)`` as DeepSpeed's Hugging Face examples pass it (``{T5Block: ('SelfAttention.o',
...)}``): parsed and checked against the model in one process, refused where it cannot hold, and checked against the
tensor-parallel split's all-reduce linears (``check_injection_policy``). The two-rank runs of the example scripts are in
``test_deepspeed_scripts_inference.py``."""

from __future__ import annotations

import logging

import pytest
import torch

import dscompile
from dscompile.errors import DSCompileConfigError
from dscompile.passes.inference_tensor_parallel import check_injection_policy, policy_from_linear_names, policy_linears

transformers = pytest.importorskip("transformers")
from transformers.models.bert.modeling_bert import BertLayer  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP  # noqa: E402


def tiny_bert() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    return transformers.BertForMaskedLM(config).eval()


def test_policy_names_the_layers_output_linears() -> None:
    model = tiny_bert()
    # DeepSpeedExamples write ('output.dense') without the comma: one string is one name
    found = policy_linears(model, {BertLayer: ("attention.output.dense", "output.dense")})
    assert set(found) == {"bert.encoder.layer.0", "bert.encoder.layer.1"}
    assert found["bert.encoder.layer.0"] == {"bert.encoder.layer.0.attention.output.dense.weight", "bert.encoder.layer.0.output.dense.weight"}


def test_one_rank_runs_the_model_and_logs_that_the_policy_has_no_effect(caplog: pytest.LogCaptureFixture) -> None:
    model, reference = tiny_bert(), tiny_bert()
    ids = torch.randint(0, 64, (2, 7))
    with caplog.at_level(logging.INFO, logger="dscompile.engines.inference"):
        engine = dscompile.init_inference(model, dtype=torch.float32, injection_policy={BertLayer: "output.dense"}, lower="eager")
    assert any("injection_policy has no effect at tp_size 1" in r.getMessage() for r in caplog.records)
    with torch.no_grad():
        torch.testing.assert_close(engine(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("policy", "kwargs", "message"),
    [
        ({LlamaDecoderLayer: ("o_proj",)}, {}, "BertForMaskedLM has no LlamaDecoderLayer layer"),
        ({BertLayer: ("output.dense", "o_proj")}, {}, r"no BertLayer has a linear named like \['o_proj'\]"),
        ({BertLayer: ("output.dense",)}, {"replace_with_kernel_inject": True}, "replace_with_kernel_inject"),
        ({"BertLayer": ("output.dense",)}, {}, "keys are layer classes"),
        ({BertLayer: ()}, {}, "expected linear names"),
        (["output.dense"], {}, "expected a dict"),
    ],
)
def test_policies_that_cannot_hold_are_refused_naming_the_key(policy: object, kwargs: dict, message: str) -> None:
    with pytest.raises(DSCompileConfigError, match=rf"injection_policy.*{message}|{message}.*injection_policy") as caught:
        dscompile.init_inference(tiny_bert(), dtype=torch.float32, injection_policy=policy, lower="eager", **kwargs)
    assert "injection_policy" in str(caught.value)


def test_split_that_disagrees_with_the_policy_is_refused() -> None:
    """The split's row-parallel linears (what dscompile all-reduces after) must be the ones the policy names."""
    model = tiny_bert()
    policy = {BertLayer: ("attention.output.dense", "output.dense")}
    rows = {f"bert.encoder.layer.{i}.{name}.weight" for i in range(2) for name in ("attention.output.dense", "output.dense")}
    check_injection_policy(model, policy, rows)  # agrees: accepted
    with pytest.raises(DSCompileConfigError, match=r"injection_policy.*at 'bert.encoder.layer.0'"):
        check_injection_policy(model, {BertLayer: ("attention.output.dense",)}, rows)  # names fewer all-reduces than the split makes
    with pytest.raises(DSCompileConfigError, match="injection_policy"):
        check_injection_policy(model, policy, rows - {"bert.encoder.layer.1.output.dense.weight"})


def test_policy_tuple_is_the_policy_with_its_layers_found_by_name() -> None:
    """DeepSpeed's ``injection_policy_tuple``: the all-reduce linears' names without a class (what DeepSpeed's engine
    fills in from an ``injection_policy`` value); each name's layer is where its matches sit."""
    from test_inference import tiny

    model = tiny("llama")
    assert policy_from_linear_names(model, ("self_attn.o_proj", "mlp.down_proj")) == {LlamaDecoderLayer: ("self_attn.o_proj", "mlp.down_proj")}
    assert policy_from_linear_names(model, ("o_proj", "down_proj")) == {LlamaAttention: ("o_proj",), LlamaMLP: ("down_proj",)}
    rows = {f"model.layers.{i}.{name}.weight" for i in range(2) for name in ("self_attn.o_proj", "mlp.down_proj")}
    check_injection_policy(model, policy_from_linear_names(model, ("o_proj", "down_proj")), rows, key="injection_policy_tuple")
    with pytest.raises(DSCompileConfigError, match=r"injection_policy_tuple.*at 'model.layers.0.self_attn'"):
        extra_row = rows | {"model.layers.0.self_attn.k_proj.weight"}
        check_injection_policy(model, policy_from_linear_names(model, ("o_proj",)), extra_row, key="injection_policy_tuple")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"injection_policy_tuple": ("self_attn.out_proj",)}, r"no linear of LlamaForCausalLM is named like 'self_attn.out_proj'"),
        ({"injection_policy_tuple": [3]}, "expected linear names"),
        ({"injection_policy_tuple": ("o_proj",), "injection_policy": {LlamaDecoderLayer: ("self_attn.o_proj",)}}, "given with injection_policy"),
        ({"injection_policy_tuple": ("o_proj",), "replace_with_kernel_inject": True}, "replace_with_kernel_inject"),
    ],
)
def test_policy_tuples_that_cannot_hold_are_refused_naming_the_key(kwargs: dict, message: str) -> None:
    from test_inference import tiny

    with pytest.raises(DSCompileConfigError, match=message) as caught:
        dscompile.init_inference(tiny("llama"), dtype=torch.float32, lower="eager", **kwargs)
    assert caught.value.key == "injection_policy_tuple"


def test_one_rank_accepts_a_policy_tuple_that_names_the_models_linears() -> None:
    from test_inference import tiny

    model, reference = tiny("llama"), tiny("llama")
    ids = torch.randint(0, 64, (2, 7))
    engine = dscompile.init_inference(model, dtype=torch.float32, injection_policy_tuple=("self_attn.o_proj", "mlp.down_proj"), lower="eager")
    with torch.no_grad():
        torch.testing.assert_close(engine(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-5, atol=1e-6)
