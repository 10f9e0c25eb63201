"""Tensor and sequence parallelism on Hugging Face models called as training scripts call them (2 gloo ranks).

``outputs = engine(input_ids=ids, labels=ids); engine.backward(outputs.loss)`` on a model built from a
config with its defaults: ``use_cache`` on, so in training mode too the model builds a ``DynamicCache``
(its first keys joined to an empty tensor) and returns it with the logits. The graph capture used to
fail on that object, and tensor parallelism left every attention block after the first whole. Now the
capture turns the cache off (``past_key_values`` comes back None), every block splits, the LM head splits by
vocabulary (the loss reads each rank's columns; the returned logits are gathered), and the loss, the returned
logits and the update equal the model's on one process.

Qwen3 normalises each query and key head (``q_norm``/``k_norm``, a mean over the head's features): its attention
splits too, and the norm weights, which each rank applies to its own heads only, get their gradient summed
over the TP group (each rank's is a part of it). Phi-3 projects q, k and v with one ``qkv_proj`` whose parts differ
in size under GQA and slices them apart: each part is split on its own (``SliceSpec.sections``). Gemma2 normalises
each block's output before adding it to the residual stream: the row-parallel output is all-reduced before the norm.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dscompile.testing.distributed import requires_backend, run_distributed_or_fail

transformers = pytest.importorskip("transformers")


def _model(arch: str) -> torch.nn.Module:
    torch.manual_seed(1)
    if arch == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
        return transformers.GPT2LMHeadModel(config)
    if arch == "qwen3":  # RMSNorm on each query and key head (q_norm, k_norm): weights shared by every rank's heads
        config = transformers.Qwen3Config(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64, vocab_size=50,
            max_position_embeddings=16,
        )
        return transformers.Qwen3ForCausalLM(config)
    if arch == "phi3":  # one fused qkv_proj of unequal parts under GQA (32 query, 16 key, 16 value features), sliced apart
        config = transformers.Phi3Config(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, vocab_size=50,
            max_position_embeddings=16, pad_token_id=0, eos_token_id=1, bos_token_id=1,
        )
        return transformers.Phi3ForCausalLM(config)
    if arch == "gemma2":  # each block's output normalised before the residual add (post-norms), logit soft-capping
        config = transformers.Gemma2Config(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64, vocab_size=50,
            max_position_embeddings=16, pad_token_id=0, eos_token_id=1, bos_token_id=1,
        )
        return transformers.Gemma2ForCausalLM(config)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, vocab_size=50, max_position_embeddings=16
    )
    return transformers.LlamaForCausalLM(config)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-6))


RUNS = [  # (arch, parallelism, lowering)
    ("gpt2", "tensor_parallel", None),  # the default lowering (Inductor)
    ("llama", "tensor_parallel", "eager"),
    ("gpt2", "sequence_parallel", "eager"),
    ("llama", "sequence_parallel", "eager"),
    ("phi3", "tensor_parallel", "eager"),
    ("gemma2", "tensor_parallel", "eager"),
]
if hasattr(transformers, "Qwen3Config"):  # transformers >= 4.51
    RUNS.append(("qwen3", "tensor_parallel", "eager"))


def _train_step(rank: int, world: int) -> dict[str, Any]:
    import dscompile

    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    ids[0, :2] = 0  # the padding token: Gemma2's tied embedding (padding_idx 0) gives its row no gradient, split by vocabulary too
    out: dict[str, Any] = {}
    for arch, parallelism, lower in RUNS:
        config: dict[str, Any] = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "train_micro_batch_size_per_gpu": 2}
        if parallelism == "tensor_parallel":
            config["tensor_parallel"] = {"autotp_size": 2, "vocab_parallel_lm_head": True}
        else:
            config["sequence_parallel_size"] = 2
        if lower is not None:
            config["lower"] = lower
        engine = dscompile.initialize(model=_model(arch), config=config)[0]
        outputs = engine(input_ids=ids, labels=ids)
        engine.backward(outputs.loss)
        engine.step()
        reference = _model(arch)
        before = {n: p.detach().clone() for n, p in reference.named_parameters()}
        expected = reference(input_ids=ids, labels=ids)
        expected.loss.backward()
        torch.optim.SGD(reference.parameters(), lr=0.1).step()
        after = engine.full_parameters()
        plan = engine.extension(parallelism).plan
        out[f"{arch}-{parallelism}"] = {
            "loss": (float(outputs.loss), float(expected.loss)),
            "logits_err": float((outputs.logits.detach() - expected.logits.detach()).abs().max()),
            "cache": outputs.past_key_values,
            # the SGD update (lr x the gradient) against one process's: each parameter's error against the largest update
            # (a norm weight's update can be 30x smaller than the others', and its rounding then reads as a large relative error)
            "update_err": max(float((after[n] - p.detach()).norm()) for n, p in reference.named_parameters())
            / max(float((p.detach() - before[n]).norm()) for n, p in reference.named_parameters()),
            "blocks": (len(plan.split), plan.replicated, len(plan.vocab)) if parallelism == "tensor_parallel" else None,
        }
    return out


@pytest.mark.distributed
@requires_backend("gloo")
def test_hugging_face_models_called_as_scripts_call_them() -> None:
    for result in run_distributed_or_fail(_train_step, 2, timeout=600):
        for key, r in result.items():
            loss, expected = r["loss"]
            assert loss == pytest.approx(expected, rel=1e-5), (key, r)
            assert r["logits_err"] < 1e-5 and r["cache"] is None, (key, r)
            assert r["update_err"] < 1e-4, (key, r)
            if r["blocks"] is not None:  # both layers' attention and MLP split, and the LM head by vocabulary (logits gathered for the output)
                split, replicated, vocab_heads = r["blocks"]
                assert split == 4 and not replicated and vocab_heads == 1, (key, r)
