"""Tensor parallelism with fewer KV heads than TP ranks (MQA, small GQA): Megatron's replicated KV heads.

With ``K`` KV heads, ``H`` query heads and TP size ``T`` where ``T % K == 0`` and ``H % T == 0``, rank ``r``
holds ``H/T`` query heads and one copy of their KV head ``r*K/T``; the ``T/K`` ranks sharing a KV head sum its
gradient in the graph, and norms count it once. The graph analysis is checked on one process; the numerics
on real gloo ranks against a single process (losses, gathered gradients and parameters after SGD steps with
clipping that clips: 1e-5).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from dscompile.passes.tensor_parallel import capture, find_blocks
from dscompile.runtime.tensor_parallel import SliceSpec
from dscompile.testing.distributed import requires_backend, run_distributed_or_fail
from dscompile.zoo import build, make_batch

MQA = {"seq_len": 8, "d_model": 16, "n_heads": 4, "n_kv_heads": 1, "n_layers": 1, "vocab_size": 40, "hidden_dim": 32}
GQA2 = {"seq_len": 8, "d_model": 32, "n_heads": 8, "n_kv_heads": 2, "n_layers": 1, "vocab_size": 40, "hidden_dim": 32}
GEMMA = {"vocab_size": 40, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}
GEMMA |= {"num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 4}
SGD = {"type": "SGD", "params": {"lr": 0.1}}
CLIP = 0.05  # below every step's gradient norm here: the clipping really scales
STEPS = 4
ZERO_STAGES = (1, 2, 3)  # over the DP group of TP=2 × DP=2: they shard what each rank holds, a KV head's copy included


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def gemma(seed: int) -> torch.nn.Module:
    """A tiny Hugging Face Gemma (one KV head: MQA) with random weights, loss from ``(input_ids, targets)``."""
    transformers = pytest.importorskip("transformers")
    from dscompile.zoo.hf import HFCausalLM

    config = transformers.GemmaConfig(**GEMMA, max_position_embeddings=64, attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = HFCausalLM(transformers.GemmaForCausalLM(config))
    return model.train()


def gemma_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, GEMMA["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(seed))
    return ids, ids.clone()


def _attention(blocks: list) -> Any:
    return next(b for b in blocks if len(b.columns) == 3)


# ---------------------------------------------------------------------------------------------- one process
@pytest.mark.parametrize(("sizes", "tp", "replicas"), [(MQA, 2, 2), (GQA2, 4, 2), (GQA2, 8, 4), (GQA2, 2, 1)])
def test_zoo_llama_kv_heads_replicated(sizes: dict, tp: int, replicas: int) -> None:
    case = build("llama", seed=0, **sizes)
    blocks, whole = find_blocks(capture(case.model, make_batch(case, seed=0), {}), tp)
    assert whole == [] and len(blocks) == 2
    attention = _attention(blocks)
    assert attention.replicas == replicas
    kv = sorted(c.weight for c in attention.columns if c.node in attention.kv)
    assert kv == (["blocks.0.attn.wk.weight", "blocks.0.attn.wv.weight"] if replicas > 1 else [])
    assert all(b.replicas == 1 for b in blocks if b is not attention)  # the MLP: as before


def test_kv_heads_that_do_not_divide_tp_stay_padded() -> None:
    sizes = {"seq_len": 8, "d_model": 24, "n_heads": 6, "n_kv_heads": 3, "n_layers": 1, "vocab_size": 41, "hidden_dim": 27}
    case = build("llama", seed=0, **sizes)
    attention = _attention(find_blocks(capture(case.model, make_batch(case, seed=0), {}), 4)[0])
    assert attention.replicas == 1 and attention.units == 3  # 3 KV heads on 4 ranks: padded, as before


@pytest.mark.parametrize("force_gqa", [False, True])
def test_hf_gemma_kv_head_replicated(monkeypatch: pytest.MonkeyPatch, force_gqa: bool) -> None:
    """Hugging Face's ``repeat_kv`` (expand + reshape), or SDPA's ``enable_gqa`` when transformers passes it."""
    if force_gqa:
        monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    gm = capture(gemma(0), gemma_batch(0), {})
    gqa = [n for n in gm.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default and n.kwargs.get("enable_gqa")]
    assert bool(gqa) == force_gqa
    blocks, whole = find_blocks(gm, 2)
    assert whole == [] and len(blocks) == 2
    attention = _attention(blocks)
    assert attention.replicas == 2 and len([c for c in attention.columns if c.node in attention.kv]) == 2


def test_replicated_slices_round_trip() -> None:
    full = torch.arange(8.0).reshape(8, 1)  # 2 KV heads of 4 rows on TP=4: ranks 0, 1 hold head 0; ranks 2, 3 head 1
    spec = SliceSpec(dim=0, replicas=2)
    parts = [spec.take(full, r, 4) for r in range(4)]
    assert [p[:, 0].tolist() for p in parts] == [[0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 6, 7], [4, 5, 6, 7]]
    assert torch.equal(spec.assemble(parts), full)


# ---------------------------------------------------------------------------------------------- gloo ranks
def _compare(engine: Any, ref: torch.nn.Module, batches: list, dp_batches: int = 1) -> dict[str, Any]:
    """``STEPS`` SGD steps with clipping on the engine and on ``ref``; the worst errors and the norms."""
    groups = engine.process_groups
    ref_opt = torch.optim.SGD(ref.parameters(), lr=SGD["params"]["lr"])
    loss_err = grad_err = 0.0
    norms = []
    for step in range(STEPS):
        mine = batches[step][groups.dp_rank if dp_batches > 1 else 0]
        loss = engine(*mine)
        engine.backward(loss)
        ref_loss = sum(ref(*b) for b in batches[step][:dp_batches]) / dp_batches
        ref_loss.backward()
        if dp_batches == 1:
            loss_err = max(loss_err, abs(float(loss.detach()) - float(ref_loss.detach())) / float(ref_loss.detach()))
            grads = engine.extension("tensor_parallel").full_gradients()
            grad_err = max(grad_err, *(_relative(grads[n], p.grad) for n, p in ref.named_parameters()))
        engine.step()
        norms.append((engine.get_global_grad_norm(), float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP))))
        ref_opt.step()
        ref_opt.zero_grad()
    full = engine.full_parameters()
    plan = engine.extension("tensor_parallel").plan
    return {
        "loss_err": loss_err,
        "grad_err": grad_err,
        "param_err": max(_relative(full[n], p.detach()) for n, p in ref.named_parameters()),
        "norms": norms,
        "split": plan.split,
        "replicated": plan.replicated,
    }


def _held(model: torch.nn.Module, ref: torch.nn.Module, q: str, k: str, head_dim: int, kv_head: int) -> dict[str, Any]:
    """This rank's q and k projection rows, and whether its k rows are its KV head's (the reference's, trained alike)."""
    local_k, full_k = model.get_parameter(k).detach(), ref.get_parameter(k).detach()
    return {
        "q_rows": model.get_parameter(q).shape[0],
        "k_rows": local_k.shape[0],
        "k_is_its_head": torch.allclose(local_k, full_k[kv_head * head_dim : (kv_head + 1) * head_dim], atol=1e-5),
    }


def two_ranks(rank: int, world: int, save_dir: str) -> dict[str, Any]:
    """TP=2: the zoo Llama with one KV head (under Inductor, the default lowering; its checkpoint consolidated), then
    Hugging Face's Gemma (one KV head) through ``repeat_kv`` and through SDPA's ``enable_gqa``."""
    import dscompile
    from dscompile.runtime.checkpoint_formats import zero_to_fp32

    cfg = {"optimizer": SGD, "tensor_parallel": {"autotp_size": 2}, "lower": "eager", "gradient_clipping": CLIP}
    case, ref = build("llama", seed=3, **MQA), build("llama", seed=3, **MQA)
    engine, *_ = dscompile.initialize(model=case.model, config={k: v for k, v in cfg.items() if k != "lower"})  # Inductor, the default
    out = {"llama": _compare(engine, ref.model, [[make_batch(case, seed=s)] for s in range(STEPS)])}
    out["llama"] |= _held(case.model, ref.model, "blocks.0.attn.wq.weight", "blocks.0.attn.wk.weight", 4, 0)
    engine.save_checkpoint(save_dir, tag="t")  # the slices' metadata carries the replicas: one copy of the KV head consolidated
    full = engine.full_parameters()
    consolidated = zero_to_fp32(save_dir) if rank == 0 else full
    out["llama"]["consolidated_err"] = max(float((consolidated[n] - full[n]).abs().max()) for n in full)
    out["llama"]["consolidated_k"] = tuple(consolidated["blocks.0.attn.wk.weight"].shape)
    layer = "model.model.layers.0.self_attn."
    for name, force_gqa in (("gemma", "0"), ("gemma_enable_gqa", "1")):  # repeat_kv, then SDPA's enable_gqa (transformers' switch)
        os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = force_gqa
        model, ref_model = gemma(3), gemma(3)
        engine, *_ = dscompile.initialize(model=model, config=cfg)
        out[name] = _compare(engine, ref_model, [[gemma_batch(s)] for s in range(STEPS)])
        out[name] |= _held(model, ref_model, layer + "q_proj.weight", layer + "k_proj.weight", GEMMA["head_dim"], 0)
    os.environ.pop("TRANSFORMERS_SDPA_FORCE_GQA")
    return out


def four_ranks(rank: int, world: int) -> dict[str, Any]:
    """TP=4 for 8 query heads over 2 KV heads; then TP=2 × DP=2 with ZeRO 1, 2 and 3 for the one-KV-head Llama."""
    import dscompile

    cfg: dict[str, Any] = {"optimizer": SGD, "tensor_parallel": {"autotp_size": 4}, "lower": "eager", "gradient_clipping": CLIP}
    case, ref = build("llama", seed=3, **GQA2), build("llama", seed=3, **GQA2)
    engine, *_ = dscompile.initialize(model=case.model, config=cfg)
    out = {"tp4": _compare(engine, ref.model, [[make_batch(case, seed=s)] for s in range(STEPS)])}
    out["tp4"] |= _held(case.model, ref.model, "blocks.0.attn.wq.weight", "blocks.0.attn.wk.weight", 4, rank * 2 // 4)
    for stage in ZERO_STAGES:
        zero_cfg = cfg | {"tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": stage}}
        case, ref = build("llama", seed=3, **MQA), build("llama", seed=3, **MQA)
        engine, *_ = dscompile.initialize(model=case.model, config=zero_cfg)
        batches = [[make_batch(case, seed=10 * s + dp) for dp in range(2)] for s in range(STEPS)]
        out[f"tp2_dp2_zero{stage}"] = _compare(engine, ref.model, batches, dp_batches=2)
        out[f"tp2_dp2_zero{stage}"]["zero_world"] = engine.zero.world if engine.zero is not None else None
    return out


def _check(r: dict[str, Any], q_rows: int, k_rows: int, kv_heads: int, ranks_per_head: int) -> None:
    assert not r["replicated"] and len(r["split"]) == 2, r  # attention and MLP both split, nothing left whole
    attention = next(e for e in r["split"] if len(e["columns"]) == 3)
    assert attention["kv_replicated"]["kv_heads"] == kv_heads and attention["kv_replicated"]["ranks_per_kv_head"] == ranks_per_head, attention
    assert len(attention["kv_replicated"]["columns"]) == 2, attention  # k and v
    assert r["loss_err"] < 1e-5 and r["grad_err"] < 1e-5 and r["param_err"] < 1e-5, r
    for norm, ref_norm in r["norms"]:  # the global norm counts each shared KV head once; and it clipped
        assert norm == pytest.approx(ref_norm, rel=1e-5) and ref_norm > CLIP, r["norms"]
    if q_rows:
        assert (r["q_rows"], r["k_rows"]) == (q_rows, k_rows) and r["k_is_its_head"], r


@pytest.mark.distributed
@requires_backend("gloo")
def test_one_kv_head_on_tp2(tmp_path) -> None:
    pytest.importorskip("transformers")
    for r in run_distributed_or_fail(two_ranks, 2, str(tmp_path), timeout=600):
        assert r["llama"]["consolidated_err"] == 0.0 and r["llama"]["consolidated_k"] == (4, 16), r["llama"]
        _check(r["llama"], q_rows=2 * 4, k_rows=4, kv_heads=1, ranks_per_head=2)  # 2 of 4 query heads, the one KV head
        for name in ("gemma", "gemma_enable_gqa"):
            _check(r[name], q_rows=2 * GEMMA["head_dim"], k_rows=GEMMA["head_dim"], kv_heads=1, ranks_per_head=2)


@pytest.mark.distributed
@pytest.mark.slow
@requires_backend("gloo")
def test_two_kv_heads_on_tp4_and_zero_over_dp() -> None:
    for r in run_distributed_or_fail(four_ranks, 4, timeout=600):
        _check(r["tp4"], q_rows=2 * 4, k_rows=4, kv_heads=2, ranks_per_head=2)  # 2 of 8 query heads, 1 of 2 KV heads
        for stage in ZERO_STAGES:
            _check(r[f"tp2_dp2_zero{stage}"], q_rows=0, k_rows=0, kv_heads=1, ranks_per_head=2)
            assert r[f"tp2_dp2_zero{stage}"]["zero_world"] == 2


def generate_with_one_kv_head(rank: int, world: int) -> dict[str, Any]:
    """Tensor-parallel inference (TP=2) of a Hugging Face Llama with one KV head: greedy tokens and logits vs one process."""
    from test_inference import left_padded_batch, tiny

    import dscompile

    ids, mask = left_padded_batch()
    model, single = (tiny("llama", num_attention_heads=4, num_key_value_heads=1) for _ in range(2))
    with torch.no_grad():
        ref = single.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    engine = dscompile.init_inference(model, dtype=torch.float32, max_out_tokens=32, lower="eager", tensor_parallel={"tp_size": 2})
    got = engine.generate(ids, attention_mask=mask, max_new_tokens=8, output_logits=True, return_dict_in_generate=True)
    attention = model.model.layers[0].self_attn
    return {
        "same_tokens": torch.equal(got.sequences, ref.sequences),
        "logit_err": float((torch.stack(got.logits) - torch.stack(ref.logits)).abs().max()),
        "cache_heads": engine._static_generator().cache_for(2, ids.device).layers[0].keys.shape[1],
        "rows": (attention.q_proj.weight.shape[0], attention.k_proj.weight.shape[0]),
        "k_is_the_head": torch.equal(attention.k_proj.weight, single.model.layers[0].self_attn.k_proj.weight),
    }


@pytest.mark.distributed
@requires_backend("gloo")
def test_inference_with_one_kv_head_on_tp2() -> None:
    pytest.importorskip("transformers")
    for r in run_distributed_or_fail(generate_with_one_kv_head, 2, timeout=600):
        assert r["same_tokens"] and r["logit_err"] < 1e-5, r
        assert r["cache_heads"] == 1 and r["rows"] == (2 * 8, 8) and r["k_is_the_head"], r  # 2 of 4 query heads; the one KV head, whole
