"""Tensor parallelism composed with mixed precision and activation checkpointing, and uneven splits (2 gloo ranks).

Each run trains the same model under TP=2 and on one process. fp32 with activation checkpointing must
equal single-process eager training (1e-5: recomputation repeats the same ops). bf16 and fp16 are
compared with a single-process dscompile engine under the same precision config: TP changes only
where partial sums are rounded (each rank's half of a row-parallel matmul is rounded to 16 bits
before the all-reduce adds the halves), so the results differ by a few 16-bit roundings. Heads and
hidden units that TP does not divide are padded with zero units: fp32 equality, and the padding stays zero.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dscompile.testing.distributed import requires_backend, run_distributed_or_fail

MODEL = {"seq_len": 8, "d_model": 16, "n_heads": 4, "n_kv_heads": 2, "n_layers": 1, "vocab_size": 40, "hidden_dim": 32}
ADAMW = {"type": "AdamW", "params": {"lr": 0.01}}
STEPS = 3


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


def _train(config: dict[str, Any], tp: bool, model: dict[str, Any] | None = None) -> dict[str, Any]:
    import dscompile
    from dscompile.zoo import build, make_batch

    case = build("llama", seed=3, **(MODEL | (model or {})))
    cfg = {k: v for k, v in config.items() if k != "tensor_parallel"} | {"optimizer": ADAMW}
    if tp:
        cfg["tensor_parallel"] = {"autotp_size": 2} | config.get("tensor_parallel", {})
    engine, optimizer, *_ = dscompile.initialize(model=case.model, config=cfg)
    losses, grads = [], None
    for step in range(STEPS):
        loss = engine(*make_batch(case, seed=step))
        engine.backward(loss)
        if step == 0:
            grads = engine.extension("tensor_parallel").full_gradients() if tp else {n: p.grad.clone() for n, p in case.model.named_parameters()}
            scale = engine.loss_scaler.cur_scale if engine.fp16_enabled() else 1.0  # fp16: the gradients are still loss-scaled
            grads = {n: g / scale for n, g in grads.items()}
        engine.step()
        losses.append(float(loss.detach().float()))
    padding_zero = True
    if tp:  # padded units (heads, hidden units TP does not divide) hold zeros after training: they took no part
        ext = engine.extension("tensor_parallel")
        full = engine.full_parameters()
        for name, spec in ext.slices().items():
            if spec.units:
                local = case.model.get_parameter(name).detach()
                padding_zero &= torch.equal(local, spec.take(full[name], ext.groups.tp_rank, ext.groups.tp_size))
    return {
        "padding_zero": padding_zero,
        "losses": losses,
        "grads": grads,
        "params": engine.full_parameters(),
        "returned_optimizer_steps": optimizer is engine.optimizer,
        "skipped": engine.skipped_steps,
    }


def _errors(run: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    return {
        "loss": max(abs(a - b) / abs(b) for a, b in zip(run["losses"], ref["losses"])),
        "grad": max(_relative(run["grads"][n], g) for n, g in ref["grads"].items()),
        "param": max(_relative(run["params"][n], p) for n, p in ref["params"].items()),
    }


def compose(rank: int, world: int, runs: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    fp32 = _train({"lower": "eager"}, tp=False)
    out = {}
    for name, config in runs:
        model = config.pop("model", None)
        tp = _train(config, tp=True, model=model)
        mixed = "bf16" in config or "fp16" in config
        truth = fp32 if model is None else _train({"lower": "eager"}, tp=False, model=model)
        ref = _train(config, tp=False) if mixed else truth
        out[name] = {
            "vs_same_precision": _errors(tp, ref),
            "vs_fp32": _errors(tp, truth),
            "single_process_vs_fp32": _errors(ref, truth),
            "same_optimizer": tp["returned_optimizer_steps"],
            "skipped": (tp["skipped"], ref["skipped"]),
            "padding_zero": tp["padding_zero"],
        }
    return out


RUNS = [
    ("ckpt", {"activation_checkpointing": {"memory_budget": 0.3}, "lower": "eager"}),
    ("bf16", {"bf16": {"enabled": True}, "lower": "eager"}),
    ("fp16", {"fp16": {"enabled": True, "initial_scale_power": 8}, "lower": "eager"}),
    # uneven: 3 KV heads (6 query heads, GQA), 27 MLP hidden units and a 41-word vocabulary (the LM head split by
    # vocabulary, with the parallel cross-entropy) on TP=2, each padded with zeros to an even split
    (
        "uneven",
        {
            "model": {"d_model": 24, "n_heads": 6, "n_kv_heads": 3, "hidden_dim": 27, "vocab_size": 41},
            "tensor_parallel": {"vocab_parallel_lm_head": True},
            "lower": "eager",
        },
    ),
]


@pytest.mark.distributed
@requires_backend("gloo")
def test_tp2_with_mixed_precision_and_checkpointing() -> None:
    results = run_distributed_or_fail(compose, 2, RUNS, timeout=600)
    for r in results:
        ckpt = r["ckpt"]["vs_same_precision"]  # recomputation repeats the same fp32 ops: as without it
        assert ckpt["loss"] < 1e-5 and ckpt["grad"] < 1e-5 and ckpt["param"] < 1e-3, ckpt  # AdamW: 1e-3
        for name in ("bf16", "fp16"):
            run = r[name]
            assert run["skipped"] == (0, 0), (name, run["skipped"])
            low = run["single_process_vs_fp32"]
            assert low["grad"] > 1e-4, (name, low)  # the 16-bit runs really computed in 16 bits
            # TP adds at most one 16-bit rounding per row-parallel output (each rank's partial sum is rounded
            # before the all-reduce adds them): against fp32 it must stay within twice single-process 16-bit's error
            for what, err in run["vs_fp32"].items():
                assert err <= 2 * low[what] + 1e-6, (name, what, err, low[what])
            assert run["vs_same_precision"]["loss"] < 1e-3, (name, run["vs_same_precision"])  # a few 16-bit roundings of the loss
        uneven = r["uneven"]["vs_same_precision"]
        assert uneven["loss"] < 1e-5 and uneven["grad"] < 1e-5 and uneven["param"] < 1e-3, uneven
        assert r["uneven"]["padding_zero"]
        assert all(r[name]["same_optimizer"] for name in r)  # the optimizer initialize returned is the one stepped
