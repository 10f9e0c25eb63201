"""Tensor-parallel inference (``init_inference(tensor_parallel={"tp_size": 2})``) on 2 gloo ranks.

Each rank builds the same tiny Hugging Face model (random weights), generates greedily with TP=2 and
compares with a single-process run of the same model and prompts (Hugging Face's eager ``generate``,
which ``tests/test_inference.py`` holds ``init_inference`` to): the tokens must
be identical and the per-step logits within 1e-5 (fp32), the KV cache of each rank must hold half the
key/value heads, and the decode graph must be captured once for all the tokens. A TP size that does
not divide the heads (6 query heads over 3 KV heads on 2 ranks) is padded and generates the same
tokens. ``lower: eager`` runs the split graphs op by op (the training
TP tests compile the same split graphs under Inductor).

With ``quant`` (int8 and int4 weight-only, HF Llama and GPT-2) and with ``replace_with_kernel_inject``, TP=2 is
compared with the same settings in one process: the same tokens, each rank's dequantized weights the
single-process ones cut, the split layers' bytes halved, the fused matmuls in each rank's graphs.

Encoder-decoder models (T5, BART) generate through Hugging Face's ``generate`` over the split encoder and decoder
graphs: the tokens and logits of Hugging Face's eager ``generate`` on the unsplit model.
"""

from __future__ import annotations

import dataclasses
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
        forward_err = float((engine(ids, attention_mask=mask).logits - ref_logits).abs().max())
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
    # DeepSpeed's injection_policy_tuple (the all-reduce linears by name): checked against the split, the same tokens
    single, model = tiny("llama"), tiny("llama")
    policy_tuple = ("self_attn.o_proj", "mlp.down_proj")
    tp2 = {"tp_size": 2}
    engine = dscompile.init_inference(model, dtype=torch.float32, max_out_tokens=32, lower="eager", tensor_parallel=tp2, injection_policy_tuple=policy_tuple)
    got = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW)
    with torch.no_grad():
        out["policy_tuple"] = torch.equal(got, single.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False))
    out["policy_tuple_blocks"] = len(engine.tensor_parallel.split_blocks)
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
        assert result["policy_tuple"] and result["policy_tuple_blocks"] == 4, (rank, result["policy_tuple"], result["policy_tuple_blocks"])
        assert "tensor_parallel.tp_size" in result["error"] and "cannot be split across 2 ranks" in result["error"], result["error"]


def _recording_graphs(engine: Any) -> list[tuple[str, torch.fx.GraphModule]]:
    """The graphs the engine's backend compiles, after dscompile's passes (the passes edit them in place)."""
    graphs: list[tuple[str, torch.fx.GraphModule]] = []
    backend = engine._backend

    def recording(name: str) -> Any:
        inner = backend(name)

        def run(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            compiled = inner(gm, example_inputs)
            graphs.append((name, gm))
            return compiled

        return run

    engine._backend = recording
    return graphs


def quantized_and_fused(rank: int, world: int) -> dict[str, Any]:
    from test_inference import left_padded_batch, tiny

    import dscompile
    from dscompile.kernels.quantize import dequantize
    from dscompile.runtime.compression.quantized import QuantizedLinear

    out: dict[str, Any] = {}
    ids, mask = left_padded_batch()
    for label, arch, bits, groups, q_type in (
        ("int8", "llama", 8, 64, "symmetric"),
        ("int4", "llama", 4, 8, "asymmetric"),
        ("gpt2_int8", "gpt2", 8, 64, "symmetric"),
    ):
        quant = {"enabled": True, "weight": {"num_bits": bits, "q_groups": groups, "q_type": q_type, "quantize_embeddings": arch == "gpt2"}}
        single = dscompile.init_inference(tiny(arch), dtype=torch.float32, max_out_tokens=32, lower="eager", quant=quant)
        ref = single.generate(ids, attention_mask=mask, max_new_tokens=NEW, output_logits=True, return_dict_in_generate=True)
        engine = dscompile.init_inference(tiny(arch), dtype=torch.float32, max_out_tokens=32, lower="eager", quant=quant, tensor_parallel={"tp_size": 2})
        got = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW, output_logits=True, return_dict_in_generate=True)
        slices = engine.tensor_parallel.slices
        layers: dict[str, Any] = {}
        for name, layer in engine.module.named_modules():
            if isinstance(layer, QuantizedLinear):
                whole = single.module.get_submodule(name)
                spec = slices.get(f"{name}.weight")
                if spec is not None and arch == "gpt2":  # Conv1D: the slice's dim counts in [in, out], the packed weight is [out, in]
                    spec = dataclasses.replace(spec, dim=1 - spec.dim)
                expected = dequantize(whole.packed) if spec is None else spec.take(dequantize(whole.packed), rank, 2)
                layers[name] = {
                    "split": spec is not None,
                    "bytes": (layer.weight_bytes(), whole.weight_bytes()),
                    "codes_bytes": (layer.qweight.numel() * layer.qweight.element_size(), whole.qweight.numel() * whole.qweight.element_size()),
                    "group_size": (layer.group_size, whole.group_size),
                    "same_values": torch.equal(dequantize(layer.packed), expected),
                    "float_weight": any(n.endswith("weight") for n, _ in layer.named_parameters()),
                }
        out[label] = {
            "same_tokens": torch.equal(got.sequences, ref.sequences),
            "logit_err": float((torch.stack(got.logits) - torch.stack(ref.logits)).abs().max()),
            "layers": layers,
            "counts": dict(engine.quantized_layers),
            "model_bytes": (engine.model_bytes(), single.model_bytes()),
        }
    try:  # q_groups that do not divide a weight: refused at init, as in a single process
        dscompile.init_inference(tiny("llama"), dtype=torch.float32, quant={"enabled": True, "weight": {"q_groups": 7}}, tensor_parallel={"tp_size": 2})
        out["groups_error"] = None
    except dscompile.DSCompileConfigError as exc:
        out["groups_error"] = str(exc)
    # kernel injection on the split graphs: fp32, against Hugging Face's eager generate in one process
    model, single = tiny("llama"), tiny("llama")
    with torch.no_grad():
        ref = single.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True)
    engine = dscompile.init_inference(
        model, dtype=torch.float32, max_out_tokens=32, lower="eager", tensor_parallel={"tp_size": 2}, replace_with_kernel_inject=True
    )
    graphs = _recording_graphs(engine)
    got = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW, output_logits=True, return_dict_in_generate=True)
    fused: dict[str, Any] = {}
    for name, gm in graphs:
        nodes = [n for n in gm.graph.nodes if "inference_fusion" in n.meta.get("dscompile", {})]
        matmuls = [n for n in nodes if "fused" in n.meta["dscompile"]["inference_fusion"]]
        fused[name] = {
            "groups": [len(n.meta["dscompile"]["inference_fusion"]["fused"]) for n in matmuls],
            "stacked_rows": [tuple(n.args[1].meta["val"].shape) for n in matmuls],
            "regions": sorted(n.meta["dscompile"]["inference_fusion"]["region"] for n in nodes if "region" in n.meta["dscompile"]["inference_fusion"]),
            "rotary": sum("rotary" in n.meta["dscompile"]["inference_fusion"] for n in nodes),
            "cache_attention": sum("cache_attention" in n.meta["dscompile"]["inference_fusion"] for n in nodes),
        }
    out["kernel_inject"] = {
        "same_tokens": torch.equal(got.sequences, ref.sequences),
        "logit_err": float((torch.stack(got.logits) - torch.stack(ref.logits)).abs().max()),
        "fused": fused,
        "compiles": dict(engine.compile_counts),
    }
    return out


@requires_backend("gloo")
def test_tp2_quantized_and_kernel_inject_match_single_process() -> None:
    """Weight-only int8 / int4 and kernel injection on TP=2 against the same settings in one process.

    Quantized (HF Llama int8 and int4 with the embedding and LM head left fp32 as by default, HF GPT-2
    int8 with ``quantize_embeddings``: through its Conv1D ``addmm``/``mm`` and its tied, packed LM head):
    each rank packs its slices with the full weight's groups (``pack_slice``), so its
    dequantized weights equal the single-process int8/int4 engine's, cut by the same slices, bit for
    bit; the products differ only by fp32 summation order (the row-parallel all-reduce), so the logits
    agree within 1e-5 and the greedy tokens exactly. int8 with 64 groups: no group crosses a slice, so
    a split layer holds exactly half the single-process bytes (codes and scales). int4 with 8 groups,
    asymmetric: the row groups of ``o_proj``/``down_proj`` (whole rows) are cut by the row-parallel
    split and stored refined (half the size, the same scales). Kernel injection: Q/K/V and gate/up fused
    into one matmul over the rank's stacked slices in every graph (forward is not called here: prefill,
    decode), the epilogue regions grouped, tokens those of Hugging Face's eager generate.
    """
    results = run_distributed_or_fail(quantized_and_fused, 2, timeout=300)
    for rank, result in enumerate(results):
        for label in ("int8", "int4", "gpt2_int8"):
            r = result[label]
            assert r["same_tokens"] and r["logit_err"] <= 1e-5, (rank, label, r["logit_err"])
            if label == "gpt2_int8":  # 4 Conv1D per block (addmm, the row-parallel ones mm), wte/wpe whole, the LM head tied to wte
                assert r["counts"] == {"linear": 8, "embedding": 2, "tied": 1, "float": 0, "sliced": 8}, r["counts"]
                assert len(r["layers"]) == 8 and all(layer["split"] for layer in r["layers"].values())
            else:  # the embedding and LM head stay fp32 (whole), as by default in one process
                assert r["counts"] == {"linear": 2 * 7, "embedding": 0, "tied": 0, "float": 2, "sliced": 2 * 7}, r["counts"]
                assert len(r["layers"]) == 14 and all(layer["split"] for layer in r["layers"].values())
            for name, layer in r["layers"].items():
                assert layer["same_values"] and not layer["float_weight"], (rank, label, name, layer)
                mine, whole = layer["codes_bytes"]
                assert mine * (2 if layer["split"] else 1) == whole, (label, name, layer)
            split_bytes = [layer["bytes"] for layer in r["layers"].values() if layer["split"]]
            if label != "int4":
                assert 2 * sum(m for m, _ in split_bytes) == sum(w for _, w in split_bytes), split_bytes
                assert all(layer["group_size"][0] == layer["group_size"][1] for layer in r["layers"].values())
            else:
                refined = {n.split(".", 3)[-1] for n, layer in r["layers"].items() if layer["group_size"][0] < layer["group_size"][1]}
                assert refined == {"self_attn.o_proj", "mlp.down_proj"}, refined
        mine, whole = result["int8"]["model_bytes"]  # the split layers halve; embedding, LM head and norms stay whole
        halved = sum(w - m for m, w in (layer["bytes"] for layer in result["int8"]["layers"].values()))
        assert halved > 0 and whole - mine == halved, (mine, whole, halved)
        assert "quant.weight.q_groups" in result["groups_error"], result["groups_error"]
        k = result["kernel_inject"]
        assert k["same_tokens"] and k["logit_err"] <= 1e-5, (rank, k["logit_err"])
        assert set(k["fused"]) == {"prefill", "decode"} and k["compiles"] == {"forward": 0, "prefill": 1, "decode": 1}, k
        for name, graph in k["fused"].items():
            assert graph["groups"] == [3, 2, 3, 2], (name, graph)  # per layer: q/k/v, then gate/up
            # stacked rows of the rank's slices: q 16 + k 8 + v 8 (half of 4 heads / 2 KV heads of 8), gate 32 + up 32
            assert graph["stacked_rows"] == [(32, 32), (64, 32)] * 2, (name, graph)
            assert graph["regions"] == ["bias_activation"] * 2 + ["residual_norm"] * 4, (name, graph)
            assert (graph["rotary"], graph["cache_attention"]) == (4, 2), (name, graph)  # Q and K per layer; one cache attention per layer


def tiny_seq2seq(arch: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    if arch == "t5":  # one layer each: the relative position bias is the first layer's
        config = transformers.T5Config(vocab_size=40, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, decoder_start_token_id=0)
        return transformers.T5ForConditionalGeneration(config).eval()
    config = transformers.BartConfig(
        vocab_size=40, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.BartForConditionalGeneration(config).eval()


def seq2seq_both(rank: int, world: int) -> dict[str, Any]:
    import dscompile

    out: dict[str, Any] = {}
    ids = torch.randint(3, 40, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a padded row: the encoder's mask reaches the split graphs
    # no early EOS from random weights: every step is compared, tokens and logits
    args = {"max_new_tokens": 8, "min_new_tokens": 8, "output_logits": True, "return_dict_in_generate": True}
    for arch in ("t5", "bart"):
        reference, model = tiny_seq2seq(arch), tiny_seq2seq(arch)
        with torch.no_grad():
            expected = reference.generate(input_ids=ids, attention_mask=mask, do_sample=False, **args)
        k_proj = "decoder.block.0.layer.1.EncDecAttention.k" if arch == "t5" else "model.decoder.layers.0.encoder_attn.k_proj"
        full = tuple(model.get_submodule(k_proj).weight.shape)
        engine = dscompile.init_inference(model, dtype=torch.float32, lower="eager", tensor_parallel={"tp_size": 2})
        got = engine.generate(ids, attention_mask=mask, **args)
        out[arch] = {
            "same_tokens": torch.equal(got.sequences, expected.sequences),
            "logit_err": float((torch.stack(got.logits) - torch.stack(expected.logits)).abs().max()),
            "length": got.sequences.shape[1],
            "weights": (full, tuple(model.get_submodule(k_proj).weight.shape)),
            "blocks": len(engine.tensor_parallel.split_blocks),
            "compiles": dict(engine.compile_counts),
        }
    return out


@requires_backend("gloo")
def test_tp2_encoder_decoder_generate_matches_hugging_face() -> None:
    """T5 and BART on TP=2: the encoder graph (self-attention, MLP) and the decoder graph (self-attention, the
    cross-attention whose query reads the decoder and keys/values the encoder, MLP) split, T5's relative position bias
    cut to each rank's heads, one graph each for all 8 steps; the greedy tokens are Hugging Face's on the unsplit model
    and each step's logits within 1e-5 (a bias cut to the other rank's heads gives the same tokens here, not the logits)."""
    results = run_distributed_or_fail(seq2seq_both, 2, timeout=300)
    for rank, result in enumerate(results):
        for arch, r in result.items():
            assert r["same_tokens"] and r["length"] == 9 and r["logit_err"] <= 1e-5, (rank, arch, r)
            assert r["weights"] == ((32, 32), (16, 32)), r["weights"]  # the cross-attention's keys: half the heads
            assert r["blocks"] == 5, r  # encoder: attention + MLP; decoder: self-attention, cross-attention, MLP
            assert r["compiles"] == {"forward": 0, "prefill": 1, "decode": 1}, r["compiles"]  # the encoder, the decoder steps
