"""Checkpoints of tensor parallelism under ZeRO, and loads across layouts (4 gloo ranks).

A Llama whose every split is padded (6 query heads over 3 KV heads, a 27-unit MLP, a 41-word vocabulary
split by rows) trains under TP=2 × DP=2 with ZeRO-1 and ZeRO-3 and AdamW (whose moments are sliced and
sharded as their parameters are), saves, and then:
- ``zero_to_fp32`` joins the TP slices of every ZeRO shard into the unsplit model's weights;
- an engine of the same layout resumes from it, loaded before its first batch (DeepSpeed scripts load
  right after ``initialize``, before the graph pass has split anything) and after it: the next step equals
  the saving engine's exactly;
- engines of other layouts resume from the ZeRO-3 checkpoint: TP=4 without ZeRO (each slice cut anew,
  padding included) and ZeRO-1 without TP over all 4 ranks. Their next step equals the saving engine's
  within 1e-5 relative: the optimizer's moments came along (a fresh AdamW would step a whole lr).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dscompile.testing.distributed import requires_backend, run_distributed_or_fail

SIZES = {"seq_len": 8, "d_model": 24, "n_heads": 6, "n_kv_heads": 3, "n_layers": 1, "vocab_size": 41, "hidden_dim": 27}
ADAMW = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}}
STAGES = (1, 3)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12))


def _engine(seed: int, config: dict[str, Any]) -> Any:
    import dscompile
    from dscompile.zoo import build

    case = build("llama", seed=seed, **SIZES)
    base = {"optimizer": ADAMW, "lower": "eager", "train_micro_batch_size_per_gpu": 2}
    return dscompile.initialize(model=case.model, config=base | config)[0], case


def _step(engine: Any, batch: tuple[torch.Tensor, ...]) -> None:
    engine.backward(engine(*batch))
    engine.step()


def _resume(rank: int, world: int, save_dir: str) -> dict[str, Any]:
    import torch.distributed as dist

    from dscompile.runtime.checkpoint_formats import zero_to_fp32
    from dscompile.zoo import make_batch

    tp2 = {"tensor_parallel": {"autotp_size": 2, "vocab_parallel_lm_head": True}}
    out: dict[str, Any] = {}
    for stage in STAGES:
        config = tp2 | {"zero_optimization": {"stage": stage}}
        saver, case = _engine(3, config)
        dp = saver.process_groups.dp_rank
        for step in range(2):
            _step(saver, make_batch(case, seed=10 * step + dp))
        tag = f"zero{stage}"
        saver.save_checkpoint(save_dir, tag=tag)
        dist.barrier()
        consolidated = zero_to_fp32(f"{save_dir}/{tag}")
        saved = saver.full_parameters()
        before, _ = _engine(4, config)  # other weights: everything must come from the checkpoint
        before.load_checkpoint(save_dir, tag=tag)
        after, _ = _engine(5, config)
        after(*make_batch(case, seed=99))  # its first batch splits and shards it
        after.load_checkpoint(save_dir, tag=tag)
        nxt = make_batch(case, seed=7 + dp)
        for engine in (saver, before, after):
            _step(engine, nxt)
        full = [e.full_parameters() for e in (saver, before, after)]
        out[stage] = {
            "consolidated_err": max(_relative(consolidated[n], saved[n]) for n in saved),
            "consolidated_names": sorted(set(saved) - set(consolidated)),
            "before_err": max(float((full[1][n] - full[0][n]).abs().max()) for n in full[0]),
            "after_err": max(float((full[2][n] - full[0][n]).abs().max()) for n in full[0]),
            "steps": (before.global_steps, after.global_steps),
        }
        if stage == STAGES[-1]:
            out["expected"] = full[0]
    batches = [make_batch(case, seed=7 + d) for d in range(2)]
    tp4, _ = _engine(6, {"tensor_parallel": {"autotp_size": 4, "vocab_parallel_lm_head": True}})
    tp4.load_checkpoint(save_dir, tag=f"zero{STAGES[-1]}")
    _step(tp4, tuple(torch.cat(parts) for parts in zip(*batches, strict=True)))  # DP=1: both replicas' batches at once
    plain, _ = _engine(7, {"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 2})
    plain.load_checkpoint(save_dir, tag=f"zero{STAGES[-1]}")
    _step(plain, batches[rank % 2])  # DP=4: the mean over both batches, twice each
    expected = out.pop("expected")
    for name, engine in (("tp4", tp4), ("no_tp_zero1", plain)):
        full = engine.full_parameters()
        out[name] = max(_relative(full[n], expected[n]) for n in expected)
    return out


@pytest.mark.distributed
@pytest.mark.slow
@requires_backend("gloo")
def test_tp_checkpoints_under_zero_resume_and_relayout(tmp_path) -> None:
    results = run_distributed_or_fail(_resume, 4, str(tmp_path), timeout=600)
    names = sorted(p.name for p in (tmp_path / "zero3").iterdir())
    for tp_rank in range(2):  # DeepSpeed's model-parallel names: one metadata file per TP rank, a shard file per rank
        assert f"mp_rank_{tp_rank:02d}_model_states.pt" in names, names
        for dp_rank in range(2):
            assert f"zero_pp_rank_{dp_rank}_mp_rank_{tp_rank:02d}_optim_states.pt" in names, names
    for r in results:
        for stage in STAGES:
            row = r[stage]
            assert row["consolidated_err"] < 1e-7 and not row["consolidated_names"], (stage, row)
            assert row["before_err"] == 0.0 and row["after_err"] == 0.0, (stage, row)  # the same layout resumes bit-exact
            assert row["steps"] == (3, 3), (stage, row)
        assert r["tp4"] < 1e-5 and r["no_tp_zero1"] < 1e-5, r
