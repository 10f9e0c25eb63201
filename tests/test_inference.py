"""``dscompile.init_inference``: generation with a static KV cache against Hugging Face's eager ``generate``.

Tiny Hugging Face models (random weights, 2 layers) built from configs. The contract, in fp32:
greedy tokens equal ``model.generate``'s exactly, the per-step logits equal Hugging Face's within
1e-5, the KV-cache logits equal a full recomputation of the sequence within 1e-5, and the decode
graph compiles once for 32 new tokens. GPT-2 runs under the default lowering (Inductor on CPU);
the other architectures under ``lower: eager`` (the same captured graphs and passes, run op by op)
to keep the file's compile time small.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import pytest
import torch

import dscompile
from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError
from dscompile.runtime.inference.generation import positions_from_mask

transformers = pytest.importorskip("transformers")

VOCAB = 96
NEW = 32


def tiny(arch: str, **overrides: object) -> torch.nn.Module:
    """A 2-layer model of ``arch`` with random weights (seeded) and no EOS, so 32 tokens always come out."""
    tf = transformers
    common = dict(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    attention = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128)
    if arch == "gpt2":
        config, cls = tf.GPT2Config, tf.GPT2LMHeadModel
    elif arch == "llama":
        config, cls = tf.LlamaConfig, tf.LlamaForCausalLM
        kwargs = {**attention, **common}
    elif arch == "mistral":
        config, cls = tf.MistralConfig, tf.MistralForCausalLM
        kwargs = {**attention, **common}
    elif arch == "opt":
        config, cls = tf.OPTConfig, tf.OPTForCausalLM
        kwargs = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, ffn_dim=64, max_position_embeddings=128, word_embed_proj_dim=32, **common)
    elif arch == "gpt_neox":  # partial rotary: half of each head's channels rotate
        config, cls = tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM
        kwargs = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64, max_position_embeddings=128, rotary_pct=0.5, **common)
    elif arch == "qwen2_moe":  # routed experts; its config keeps sliding_window=0 with every layer listed as full attention
        config, cls = tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM
        kwargs = dict(**attention, **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32)
    elif arch == "bert":
        config, cls = tf.BertConfig, tf.BertForMaskedLM
        kwargs = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64)
    else:
        raise ValueError(arch)
    if arch == "gpt2":
        kwargs = dict(n_layer=2, n_embd=32, n_head=2, n_positions=128, **common)
    kwargs.update(overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = cls(config(**kwargs)).eval()
    return model


def left_padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of 7 and 4 tokens, the shorter one left padded."""
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 0
    return ids, mask


def recompute_logits(model: torch.nn.Module, sequences: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
    """Logits of every position of the whole sequence in one forward, no cache."""
    mask = torch.cat([prompt_mask, torch.ones_like(sequences[:, prompt_mask.shape[1] :])], dim=1)
    with torch.no_grad():
        return model(input_ids=sequences, attention_mask=mask, position_ids=positions_from_mask(mask), use_cache=False).logits


@contextlib.contextmanager
def pass_messages(*names: str) -> Iterator[list[str]]:
    """The INFO messages of the ``dscompile.passes.<name>`` loggers while the block runs."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    loggers = [logging.getLogger(f"dscompile.passes.{name}") for name in names]
    old_levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    messages: list[str] = []
    try:
        yield messages
    finally:
        for logger, level in zip(loggers, old_levels):
            logger.removeHandler(handler)
            logger.setLevel(level)
        messages.extend(r.getMessage() for r in records)


def epilogue_counts(messages: list[str]) -> list[str]:
    return [m.split(": ", 1)[1] for m in messages if "regions fused" in m]


def check_against_hf(
    arch: str, lower: str | None, second_request: bool = False, kernel_inject: bool = False, loggers: tuple[str, ...] = ("inference_epilogues",)
) -> list[str]:
    model = tiny(arch)
    ids, mask = left_padded_batch()
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
    engine = dscompile.init_inference(model, dtype=torch.float32, max_out_tokens=64, lower=lower, replace_with_kernel_inject=kernel_inject)
    with pass_messages(*loggers) as messages:
        out = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref.sequences), (arch, out.sequences, ref.sequences)
    ours = torch.stack(out.logits, dim=1)
    theirs = torch.stack(ref.logits, dim=1)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    full = recompute_logits(model, out.sequences, mask)[:, ids.shape[1] - 1 : -1]
    torch.testing.assert_close(ours, full, rtol=0, atol=1e-5)
    assert engine.compile_counts["decode"] == 1 and engine.compile_counts["prefill"] == 1, engine.compile_counts
    if second_request:  # another prompt length: the decode graph is reused, not recompiled
        engine.generate(ids[:, 2:], attention_mask=mask[:, 2:], max_new_tokens=4)
        assert engine.compile_counts["decode"] == 1, engine.compile_counts
    return messages


@pytest.mark.slow
def test_gpt2_greedy_matches_hf_under_inductor() -> None:
    """The default lowering, with the inference fusion passes on (kernel injection): the fused regions under Inductor."""
    messages = check_against_hf("gpt2", None, kernel_inject=True)
    # prefill and decode graphs: GPT-2's tanh GeLU after c_fc, and each residual add with the LayerNorm after it
    assert epilogue_counts(messages) == ["2 bias + activation and 4 residual + norm regions fused"] * 2, messages


@pytest.mark.parametrize("arch", ["llama", "mistral", "opt", "qwen2_moe"])
def test_greedy_matches_hf(arch: str) -> None:
    check_against_hf(arch, "eager", second_request=arch == "llama")


def test_many_engines_in_one_process_generate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every engine's prefill and decode steps share their code objects, and each engine adds its own Dynamo entries
    (the guards name its model). Past Dynamo's per-code limit (8; 2 here, so that the third engine reaches it) an
    engine's steps ran uncompiled and its decode failed under the steady stance ("Recompilation triggered with
    skip_guard_eval_unsafe"): each engine makes room for its own entries."""
    from dscompile.runtime import dynamo_room

    monkeypatch.setattr(dynamo_room, "_reserved", 0)
    monkeypatch.setattr(dynamo_room, "_limits", None)  # make_room reads the limits below as Dynamo's own
    ids, mask = left_padded_batch()
    with torch.no_grad():
        expected = tiny("gpt2").generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    # Dynamo's own patch, not monkeypatch: pytest >= 9.2 restores a ConfigModule entry by deleting it, which
    # hides the setting from every later test in the worker ("recompile_limit does not exist")
    with torch._dynamo.config.patch(recompile_limit=2, accumulated_recompile_limit=2):
        for _ in range(4):
            engine = dscompile.init_inference(tiny("gpt2"), dtype=torch.float32, max_out_tokens=32, lower="eager")
            assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=4), expected)
            assert engine.compile_counts["prefill"] == 1 and engine.compile_counts["decode"] == 1, engine.compile_counts


def test_bert_forward_logits() -> None:
    model = tiny("bert")
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    engine = dscompile.init_inference(model, dtype=torch.float32, lower="eager")
    with torch.no_grad():
        expected = model(ids).logits
    torch.testing.assert_close(engine(ids).logits, expected, rtol=0, atol=1e-5)
    with pytest.raises(TypeError, match="causal language model"):
        engine.generate(ids, max_new_tokens=2)


def test_sampling_seeded_and_eos() -> None:
    model = tiny("llama")
    ids, mask = left_padded_batch()
    engine = dscompile.init_inference(model, dtype=torch.float32, max_out_tokens=48, lower="eager")
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=True, temperature=0.8, top_k=20, top_p=0.9)
    first = engine.generate(ids, seed=5, **kwargs)
    assert torch.equal(first, engine.generate(ids, seed=5, **kwargs))
    assert not torch.equal(first, engine.generate(ids, seed=6, **kwargs))
    # from the global generator, as Hugging Face samples: same seed, same tokens
    torch.manual_seed(3)
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
    torch.manual_seed(3)
    assert torch.equal(engine.generate(ids, **kwargs), ref)
    # EOS: the row that emits it is padded afterwards; generation stops once every row has
    greedy = engine.generate(ids, attention_mask=mask, max_new_tokens=10)
    eos = int(greedy[0, ids.shape[1] + 2])
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=eos, pad_token_id=0), ref)
    assert engine.compile_counts["decode"] == 1, engine.compile_counts


def test_lengths_and_config_refused_clearly() -> None:
    model = tiny("gpt2")
    engine = dscompile.init_inference(model, dtype=torch.float32, max_out_tokens=8, lower="eager")
    ids = torch.ones((1, 9), dtype=torch.long)
    with pytest.raises(DSCompileConfigError, match="more than max_out_tokens=8"):
        engine.generate(ids, max_new_tokens=1)
    with pytest.raises(DSCompileConfigError, match="exceed max_out_tokens=8"):
        engine.generate(ids[:, :4], max_new_tokens=5)
    with pytest.raises(DSCompileConfigError, match="tensor_parallel.tp_size.*world of 1 process"):
        dscompile.init_inference(model, tensor_parallel={"tp_size": 2})  # one process: no TP group of 2
    with pytest.raises(DSCompileConfigError, match="tensor_parallel.tp_size.*world of 1 process"):
        dscompile.init_inference(model, mp_size=2)  # DeepSpeed's old name of tp_size, read as it
    with pytest.raises(DSCompileConfigError, match="'mp_size'.*tensor_parallel.tp_size"):
        dscompile.init_inference(model, config={"mp_size": 2, "tensor_parallel": {"tp_size": 2}})
    with pytest.raises(DSCompileConfigError, match="did you mean 'max_out_tokens'"):
        dscompile.init_inference(model, max_out_token=3)
    with pytest.raises(DSCompileConfigError, match="'max_out_tokens'.*keep only"):
        dscompile.init_inference(model, config={"max_tokens": 4, "max_out_tokens": 4})
    with pytest.raises(DSCompileNotSupportedError, match="enable_cuda_graph"):
        dscompile.init_inference(model, enable_cuda_graph=True)
    with pytest.raises(DSCompileNotSupportedError, match="quant.activation.enabled"):
        dscompile.init_inference(model, quant={"enabled": True, "activation": {"enabled": True}})
    with pytest.raises(DSCompileConfigError, match="quant.weight.num_bits"):
        dscompile.init_inference(model, quant={"enabled": True, "weight": {"num_bits": 2}})
    with pytest.raises(DSCompileConfigError, match="dtype"):
        dscompile.init_inference(model, dtype=torch.int8)
    # DeepSpeed's defaults of unbuilt keys load (a full DeepSpeed inference config)
    config = {"kernel_inject": False, "tp": {"tp_size": 1}, "zero": {}, "moe": False, "replace_method": "auto", "max_tokens": 16, "dtype": "fp32"}
    assert dscompile.init_inference(tiny("gpt2"), config=config)._config.max_out_tokens == 16


def test_dce_keeps_in_place_tensor_methods() -> None:
    """A Dynamo graph's ``buf.add_(1)`` whose result is unused is state (a KV cache write), not dead code."""

    def step(x: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
        counter.add_(1)
        return x * 2

    compiled = torch.compile(step, backend="dscompile", options={"pipeline": "dce,lower(eager)"})
    counter = torch.zeros(())
    compiled(torch.ones(2), counter)
    compiled(torch.ones(2), counter)
    assert counter.item() == 2


@pytest.mark.parametrize("arch,groups,regions", [("llama", 4, (2, 4)), ("opt", 2, (2, 5))])
def test_kernel_inject_fuses_shared_input_matmuls(arch: str, groups: int, regions: tuple[int, int]) -> None:
    """Q/K/V (and a gated MLP's gate/up) found in the graph and run as one matmul, and the bias + activation
    and residual + norm regions grouped (``regions``: their counts per graph, 2 layers): same tokens and
    logits as eager."""
    model = tiny(arch)
    ids, mask = left_padded_batch()
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        logits = model(ids, attention_mask=mask).logits
    engine = dscompile.init_inference(model, dtype=torch.float32, max_out_tokens=32, lower="eager", replace_with_kernel_inject=True)
    with pass_messages("inference_fusion", "inference_epilogues") as messages:
        torch.testing.assert_close(engine(ids, attention_mask=mask).logits, logits, rtol=0, atol=1e-5)
        assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=8), ref)
    fused = [m for m in messages if "sharing an input fused" in m]
    assert len(fused) == 3 and all(m.endswith(f": {groups} groups of linear layers sharing an input fused") for m in fused), fused
    expected = f"{regions[0]} bias + activation and {regions[1]} residual + norm regions fused"
    assert epilogue_counts(messages) == [expected] * 3, messages  # forward, prefill, decode
    assert engine.compile_counts["decode"] == 1


def test_fusion_skipped_with_gradients_on() -> None:
    from dscompile.passes.inference_fusion import shared_input_groups

    lin = torch.nn.ModuleList([torch.nn.Linear(8, 4), torch.nn.Linear(8, 6)])
    compiled = torch.compile(lambda x: lin[0](x) * 2 + lin[1](x)[:, :4], backend="dscompile", options={"pipeline": "fuse_shared_input_matmuls,lower(eager)"})
    x = torch.randn(3, 8, requires_grad=True)
    out = compiled(x)
    out.sum().backward()  # trained as written: gradients reach both weights
    assert lin[0].weight.grad is not None and lin[1].weight.grad is not None
    graph = torch.fx.symbolic_trace(lambda x: torch.nn.functional.linear(x, torch.ones(2, 8)) + torch.nn.functional.linear(x, torch.ones(2, 8)))
    assert len(shared_input_groups(graph)) == 1
