"""Tensor-parallel inference (``init_inference(tensor_parallel={"tp_size": 2})``) on 2 gloo ranks.

Each rank builds the same tiny Hugging Face model (random weights), generates greedily with TP=2 and
compares with a single-process run of the same model and prompts (Hugging Face's eager ``generate``,
which ``tests/test_inference.py`` holds ``init_inference`` to): the tokens must
be identical and the per-step logits within 1e-5 (fp32), the KV cache of each rank must hold half the
key/value heads, and the decode graph must be captured once for all the tokens. A TP size that does
not divide the heads (6 query heads over 3 KV heads on 2 ranks) is padded and generates the same
tokens. ``lower: eager`` runs the split graphs op by op (the training
TP tests compile the same split graphs under Inductor).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dscompile.testing.distributed import requires_backend, run_distributed_or_fail

pytest.importorskip("transformers")

NEW = 12


def generate_both(rank: int, world: int) -> dict[str, Any]:
    from test_inference import left_padded_batch, tiny

    import dscompile
    from dscompile.errors import DSCompileConfigError

    out: dict[str, Any] = {}
    ids, mask = left_padded_batch()
    for arch in ("gpt2", "llama"):
        single = tiny(arch)  # the single-process reference: Hugging Face's eager generate (equal to init_inference's, test_inference.py)
        with torch.no_grad():
            ref = single.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
            ref_logits = single(ids, attention_mask=mask).logits
        model = tiny(arch)
        full_q = model.get_submodule("transformer.h.0.attn.c_attn" if arch == "gpt2" else "model.layers.0.self_attn.q_proj").weight.shape
        engine = dscompile.init_inference(model, dtype=torch.float32, max_out_tokens=32, lower="eager", tensor_parallel={"tp_size": 2})
        got = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW, output_logits=True, return_dict_in_generate=True)
        sliced_q = model.get_submodule("transformer.h.0.attn.c_attn" if arch == "gpt2" else "model.layers.0.self_attn.q_proj").weight.shape
        cache = engine._static_generator().cache_for(2, ids.device)
        forward_err = float((engine(ids, attention_mask=mask) - ref_logits).abs().max())
        out[arch] = {
            "same_tokens": torch.equal(got.sequences, ref.sequences),
            "logit_err": float((torch.stack(got.logits) - torch.stack(ref.logits)).abs().max()),
            "forward_err": forward_err,
            "weights": (tuple(full_q), tuple(sliced_q)),
            "cache_heads": cache.layers[0].keys.shape[1],
            "compiles": dict(engine.compile_counts),
            "blocks": len(engine.tensor_parallel.split_blocks),
        }
        again = engine.generate(ids[:, 2:], attention_mask=mask[:, 2:], max_new_tokens=3)  # another prompt length: its own prefill graph
        with torch.no_grad():
            out[arch]["same_tokens_again"] = torch.equal(again, single.generate(ids[:, 2:], attention_mask=mask[:, 2:], max_new_tokens=3, do_sample=False))
        out[arch]["compiles_after"] = dict(engine.compile_counts)
    # 6 query heads over 3 KV heads on TP=2: KV groups 2 + 1, padded (rank 1 runs a zero-weight group, its cache a zero head)
    uneven, single = (tiny("llama", hidden_size=24, num_attention_heads=6, num_key_value_heads=3) for _ in range(2))
    engine = dscompile.init_inference(uneven, dtype=torch.float32, max_out_tokens=32, lower="eager", tensor_parallel={"tp_size": 2})
    got = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        ref = single.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
    out["uneven"] = {
        "same_tokens": torch.equal(got.sequences, ref.sequences),
        "logit_err": float((torch.stack(got.logits) - torch.stack(ref.logits)).abs().max()),
        "cache_heads": engine._static_generator().cache_for(2, ids.device).layers[0].keys.shape[1],
    }
    try:  # a model the pass finds nothing to split in: a clear error
        dscompile.init_inference(torch.nn.Linear(4, 4), dtype=torch.float32, lower="eager", tensor_parallel={"tp_size": 2})(torch.randn(2, 4))
        out["error"] = None
    except DSCompileConfigError as exc:
        out["error"] = str(exc)
    return out


@requires_backend("gloo")
def test_tp2_generation_matches_single_process() -> None:
    results = run_distributed_or_fail(generate_both, 2, timeout=300)
    for rank, result in enumerate(results):
        for arch in ("gpt2", "llama"):
            r = result[arch]
            assert r["same_tokens"] and r["same_tokens_again"], (rank, arch)
            assert r["logit_err"] <= 1e-5 and r["forward_err"] <= 1e-5, (rank, arch, r)
            full, sliced = r["weights"]
            assert (sliced[1] if arch == "gpt2" else sliced[0]) * 2 == (full[1] if arch == "gpt2" else full[0]), (arch, full, sliced)
            assert r["cache_heads"] == 1, r  # gpt2: 2 heads, llama: 2 KV heads (GQA), halved
            assert r["blocks"] == 4, r  # attention + MLP of both layers
            assert r["compiles"] == {"forward": 1, "prefill": 1, "decode": 1}, r["compiles"]
            assert r["compiles_after"] == {"forward": 1, "prefill": 2, "decode": 1}, r["compiles_after"]
        u = result["uneven"]
        assert u["same_tokens"] and u["logit_err"] <= 1e-5 and u["cache_heads"] == 2, (rank, u)  # ceil(3 / 2) KV heads per rank
        assert "tensor_parallel.tp_size" in result["error"] and "cannot be split across 2 ranks" in result["error"], result["error"]
