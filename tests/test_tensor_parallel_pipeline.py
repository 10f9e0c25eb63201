"""3D parallelism's model-parallel half: tensor parallelism inside pipeline stages (4 gloo ranks: TP=2 × 2 stages).

The tensor-parallel pass splits the captured graph, the pipeline cuts the split graph into stages, and
each stage runs its slice of every block on its TP group; p2p pairs the ranks of equal TP rank. Every
run is compared with the single-process run of the same micro-batches (gradients accumulated, one step
per batch), with the issue's tolerances: SGD within 1e-5 relative, AdamW within 1e-3 (TP changes the
order of partial sums, and Adam turns the rounding of near-zero gradients into whole-lr steps).
Gradient clipping is on, so the norm across stages and TP slices (replicated parameters once) is checked too.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dscompile.testing.distributed import requires_backend, run_distributed_or_fail

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, MICRO = 4, 2
CLIP = 0.5
LLAMA = {"seq_len": 8, "d_model": 16, "n_heads": 4, "n_kv_heads": 2, "n_layers": 2, "vocab_size": 40, "hidden_dim": 32}
LLAMA_MQA = LLAMA | {"n_kv_heads": 1}  # one KV head: replicated on both TP ranks (tests/test_tensor_parallel_kv_replication.py)
HF_LLAMA = {"hidden": 32, "n_heads": 4, "n_layers": 2, "vocab_size": 64, "seq_len": 8}


def _optimizer(name: str) -> dict[str, Any]:
    # weight decay given: the engine's AdamW defaults to DeepSpeed's 0, torch's (the reference) to 0.01
    return {"type": "SGD", "params": {"lr": 0.1}} if name == "sgd" else {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}


def _case(model: str) -> Any:
    from dscompile.zoo import build

    if model == "llama_mqa":
        return build("llama", seed=3, **LLAMA_MQA)
    return build("llama", seed=3, **LLAMA) if model == "llama" else build("hf_llama", seed=3, **HF_LLAMA)


def _batches(case: Any) -> list[tuple[torch.Tensor, ...]]:
    from dscompile.zoo import make_batch

    return [tuple(make_batch(case, seed=100 * s + m)) for s in range(STEPS) for m in range(MICRO)]


def _reference(model: str, optimizer: str) -> dict[str, Any]:
    """One process, no parallelism: the same micro-batches accumulated, clipped, one step per batch."""
    case = _case(model)
    params = list(case.model.parameters())
    opt = torch.optim.SGD(params, lr=0.1) if optimizer == "sgd" else torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    data = _batches(case)
    losses = []
    for s in range(STEPS):
        total = 0.0
        for m in range(MICRO):
            loss = case.model(*data[s * MICRO + m])
            (loss / MICRO).backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(total / MICRO)
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in case.model.named_parameters()}}


def _train(rank: int, world: int, runs: list[tuple[str, str, str]], save_dir: str | None = None) -> dict[str, Any]:
    import dscompile
    from dscompile.engines.pipeline_parallel import PipelineEngine

    out: dict[str, Any] = {}
    for model, optimizer, lower in runs:
        case = _case(model)
        config = {
            **({"lower": lower} if lower != "default" else {}),
            "gradient_clipping": CLIP,
            "optimizer": _optimizer(optimizer),
            "tensor_parallel": {"autotp_size": 2},
            "pipeline": {"stages": 2, "schedule": "1f1b", "micro_batches": MICRO},
        }
        if model == "hf_llama":  # as a DeepSpeed script: initialize, batch sizes counted over the one data-parallel replica
            config |= {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": MICRO, "train_batch_size": 2 * MICRO}
            engine, *_ = dscompile.initialize(model=case.model, config=config)
            assert isinstance(engine, PipelineEngine)
        else:
            engine = PipelineEngine(case.model, config)
        data = _batches(case)
        if rank % 2:  # TP rank 1 reads other batches: the engine must feed it its TP group's (rank 0's)
            data = [tuple(t.flip(0) for t in batch) for batch in data]
        it = iter(data)
        losses = [float(engine.train_batch(it)) for _ in range(STEPS)]
        sliced = engine.tensor_parallel_plan.slices
        local = {n: p for n, p in case.model.named_parameters() if p.numel()}
        out[f"{model}/{optimizer}"] = {
            "losses": losses,
            "params": engine.stage_parameters(),
            "stage": engine.stage_id,
            "tp_rank": engine.tp_rank,
            "blocks_split": len(engine.tensor_parallel_plan.split),
            "kv_replicated": sum("kv_replicated" in e for e in engine.tensor_parallel_plan.split),
            # bytes this rank holds of the layers TP split, against their full size
            "held": sum(local[n].numel() for n in sliced if n in local),
            "full": sum(engine.stage_parameters()[n].numel() for n in sliced if n in local),
        }
        if save_dir is not None and (model, optimizer, lower) == runs[0]:
            out["resume"] = _save_and_resume(engine, model, config, data, save_dir)
    return out


def _save_and_resume(engine: Any, model: str, config: dict[str, Any], data: list[Any], save_dir: str) -> dict[str, Any]:
    """Each TP rank's stage slices saved and resumed by an engine built from other weights (loaded before its first
    batch), one more batch on both; the 16-bit model file holds the whole tensors (the slices gathered)."""
    from dscompile.engines.pipeline_parallel import PipelineEngine
    from dscompile.zoo import build

    engine.save_checkpoint(save_dir, tag="pp")
    engine.save_16bit_model(save_dir, "model16.bin")
    again = PipelineEngine(build("llama", seed=9, **LLAMA).model, config)
    again.load_checkpoint(save_dir, tag="pp")
    for e in (engine, again):
        e.train_batch(iter(data[:MICRO]))
    after = [engine.stage_parameters(), again.stage_parameters()]
    return {"err": max(float((after[0][n] - after[1][n]).abs().max()) for n in after[0]), "steps": (engine.global_steps, again.global_steps)}


# the zoo's Llama (GQA) in eager; Hugging Face's Llama built from a config under the default lowering (Inductor)
RUNS = [("llama", "sgd", "eager"), ("hf_llama", "adamw", "default")]


@requires_backend("gloo")
def test_tp2_times_two_pipeline_stages_equal_single_process(tmp_path) -> None:
    ranks = run_distributed_or_fail(_train, 4, RUNS, str(tmp_path), timeout=900)
    first = f"{RUNS[0][0]}/{RUNS[0][1]}"
    assert [(r[first]["stage"], r[first]["tp_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]  # TP innermost
    _compare(ranks, RUNS)
    for r in ranks:  # resumed from each TP rank's files: bit-exact, counters too
        assert r["resume"]["err"] == 0.0 and r["resume"]["steps"] == (STEPS + 1, STEPS + 1), r["resume"]
    names = sorted(p.name for p in (tmp_path / "pp").iterdir())
    assert "pipe_stage_01_mp_rank_01_model_states.pt" in names and "pipe_rank_00_mp_rank_01_states.pt" in names, names
    whole = torch.load(tmp_path / "model16.bin")  # the slices gathered: the unsplit model's tensors, as trained
    ref = _reference(*RUNS[0][:2])["params"]
    assert whole.keys() >= ref.keys()
    for name, want in ref.items():
        assert whole[name].shape == want.shape and float((whole[name] - want).norm() / want.norm()) < 1e-5, name


@requires_backend("gloo")
def test_one_kv_head_replicated_in_pipeline_stages() -> None:
    """The KV head both TP ranks hold: its gradient summed over them inside each stage, the norm counting it once."""
    runs = [("llama_mqa", "sgd", "eager")]
    ranks = run_distributed_or_fail(_train, 4, runs, timeout=600)
    assert all(r["llama_mqa/sgd"]["kv_replicated"] == LLAMA_MQA["n_layers"] for r in ranks), ranks
    _compare(ranks, runs, halves=False)  # k/v projections are whole on each rank: not half of the split layers


def _compare(ranks: list[dict[str, Any]], runs: list[tuple[str, str, str]], halves: bool = True) -> None:
    for model, optimizer, _ in runs:
        key = f"{model}/{optimizer}"
        ref = _reference(model, optimizer)
        # AdamW: the issue allows 1e-3; measured 3.4e-6, so 1e-4 still catches a weight-decay mismatch (1e-4 a step)
        tol = 1e-5 if optimizer == "sgd" else 1e-4
        params: dict[str, torch.Tensor] = {}
        for r in ranks:
            run = r[key]
            assert run["blocks_split"] >= 2, (key, run["blocks_split"])  # attention and MLP of each layer
            for got, want in zip(run["losses"], ref["losses"]):
                assert abs(got - want) <= tol * abs(want), (key, run["losses"], ref["losses"])
            assert run["full"] > 0 and (run["held"] * 2 == run["full"] or not halves), (key, run["held"], run["full"])  # each TP rank: half
            params.update(run["params"])
        assert params.keys() == ref["params"].keys(), key  # the stages together hold the whole model
        for name, want in ref["params"].items():
            err = float((params[name].double() - want.double()).norm() / want.double().norm().clamp_min(1e-12))
            assert err <= tol, (key, name, err)
