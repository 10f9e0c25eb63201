"""Tensor parallelism found from the graph (``passes/tensor_parallel/``) on 2 gloo ranks.

Each model trains under TP=2 and on a single process from the same weights and batches: the losses,
the gradients (TP slices gathered) and the parameters after a few optimizer steps must agree (fp32:
1e-5; AdamW 1e-3 relative). Every rank must hold only its slices of the split layers. The default
lowering (Inductor) compiles the split graphs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dscompile.testing.distributed import requires_backend, run_distributed_or_fail

CASES: dict[str, dict[str, Any]] = {
    "gpt": {"seq_len": 8, "d_model": 16, "n_heads": 2, "n_layers": 1, "vocab_size": 40},
    "llama": {"seq_len": 8, "d_model": 16, "n_heads": 4, "n_kv_heads": 2, "n_layers": 1, "vocab_size": 40, "hidden_dim": 32},
    "hf_gpt2": {"seq_len": 8, "hidden": 16, "n_heads": 2, "n_layers": 1, "vocab_size": 40},
    "hf_llama": {"seq_len": 8, "hidden": 16, "n_heads": 2, "n_layers": 1, "vocab_size": 40},
}
STEPS = 10  # the issue: 10 training steps equal single-process training


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def checkpoint_round_trip(rank: int, save_dir: str) -> dict[str, Any]:
    """Save a TP=2 engine, consolidate with zero-to-fp32, resume into a new engine (own slices, optimizer too)."""
    import dscompile
    from dscompile.runtime.checkpoint_formats import zero_to_fp32
    from dscompile.zoo import build, make_batch

    cfg = {"optimizer": ADAMW, "tensor_parallel": {"autotp_size": 2}, "lower": "eager"}
    engines = []
    for _ in range(2):
        case = build("gpt", seed=3 + len(engines), **CASES["gpt"])  # the second starts from other weights
        engines.append(dscompile.initialize(model=case.model, config=cfg)[0])
    first, second = engines
    for step in range(2):
        first.backward(first(*make_batch(case, seed=step)))
        first.step()
    first.save_checkpoint(save_dir, tag="t")
    consolidated = zero_to_fp32(save_dir) if rank == 0 else {}
    full = first.full_parameters()
    second(*make_batch(case, seed=0))  # its first batch splits it; then it loads its own slices and AdamW states
    second.load_checkpoint(save_dir, tag="t")
    batch = make_batch(case, seed=5)
    for engine in engines:
        engine.backward(engine(*batch))
        engine.step()
    after = [e.full_parameters() for e in engines]
    # an evaluation loop: eval mode and another batch size are captured anew (from the gathered weights), then training goes on
    reference = build("gpt", seed=3, **CASES["gpt"]).model
    reference.load_state_dict(after[1], strict=False)
    small = tuple(t[:1] for t in make_batch(case, seed=6))
    second.eval()
    with torch.no_grad():
        eval_losses = [float(second(*b)) for b in (small, batch)]
        expected_eval = [float(reference.eval()(*b)) for b in (small, batch)]
    second.train()
    for engine in engines:
        engine.backward(engine(*batch))
        engine.step()
    again = [e.full_parameters() for e in engines]
    return {
        "consolidated_err": max((float((consolidated[n] - full[n]).abs().max()) for n in full), default=0.0) if rank == 0 else 0.0,
        "consolidated_names": sorted(consolidated) if rank == 0 else sorted(full),
        "names": sorted(full),
        "resume_err": max(float((after[0][n] - after[1][n]).abs().max()) for n in full),
        "steps": second.global_steps,
        "eval": (eval_losses, expected_eval),
        "held_after_eval": max(float((again[0][n] - again[1][n]).abs().max()) for n in full),
    }


def train_and_compare(rank: int, world: int, runs: list[tuple[str, dict, str | None, float, dict]], save_dir: str) -> dict[str, Any]:
    import dscompile
    from dscompile.zoo import build, make_batch

    out: dict[str, Any] = {}
    for name, optimizer, lower, clip, overrides in runs:
        model = CASES[name] | {k: v for k, v in overrides.items() if k != "tensor_parallel"}
        case, ref = build(name, seed=3, **model), build(name, seed=3, **model)
        full_bytes = {n: p.numel() * p.element_size() for n, p in case.model.named_parameters()}
        cfg: dict[str, Any] = {"optimizer": optimizer, "tensor_parallel": {"autotp_size": 2} | overrides.get("tensor_parallel", {})}
        if lower is not None:
            cfg["lower"] = lower
        if clip:
            cfg["gradient_clipping"] = clip
        engine, *_ = dscompile.initialize(model=case.model, config=cfg)
        ref_opt = getattr(torch.optim, optimizer["type"])(ref.model.parameters(), lr=optimizer["params"]["lr"])
        losses, ref_losses, grad_err, norms = [], [], 0.0, []
        for step in range(STEPS):
            batch = make_batch(case, seed=step)
            # rank 1 is handed another batch: the engine broadcasts rank 0's within the TP group (DeepSpeed #7199)
            loss = engine(*(batch if rank == 0 else make_batch(case, seed=step + 1000)))
            engine.backward(loss)
            ref_loss = ref.model(*batch)
            ref_loss.backward()
            if step == 0:
                grads = engine.extension("tensor_parallel").full_gradients()
                grad_err = max(_relative(grads[n], p.grad) for n, p in ref.model.named_parameters())
            engine.step()
            if clip:
                norms.append((engine.get_global_grad_norm(), float(torch.nn.utils.clip_grad_norm_(ref.model.parameters(), clip))))
            ref_opt.step()
            ref_opt.zero_grad()
            losses.append(float(loss.detach()))
            ref_losses.append(float(ref_loss.detach()))
        full = engine.full_parameters()
        plan = engine.extension("tensor_parallel").plan
        sliced = set(plan.slices)
        held = sum(p.numel() * p.element_size() for n, p in case.model.named_parameters() if n in sliced)
        out[f"{name}/{optimizer['type']}/{lower or 'inductor'}/{clip}/{overrides}"] = {
            "losses": losses,
            "ref_losses": ref_losses,
            "grad_err": grad_err,
            "param_err": max(_relative(full[n], p.detach()) for n, p in ref.model.named_parameters()),
            "name": name,
            "norms": norms,
            "clip": clip,
            "held_fraction": held / sum(full_bytes[n] for n in sliced),
            "blocks_split": len(plan.split),
            "blocks_replicated": plan.replicated,
            "vocab": plan.vocab,
        }
    out["checkpoint"] = checkpoint_round_trip(rank, save_dir)
    return out


SGD = {"type": "SGD", "params": {"lr": 0.1}}
# weight decay given: the engine's AdamW defaults to DeepSpeed's 0, torch's reference to 0.01
ADAMW = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}}
# Inductor (the default lowering) for the GQA Llama; the others under the eager lowering, to keep the test's
# compile time within budget (the same split graph reaches either lowering; all four pass under Inductor too).
# (model, optimizer, lowering, gradient_clipping, model overrides); AdamW is compared on 4 ranks (below)
RUNS = [
    ("llama", SGD, None, 0.0, {}),
    ("hf_gpt2", SGD, "eager", 0.0, {}),
    ("hf_llama", SGD, "eager", 0.0, {}),
    ("gpt", SGD, "eager", 0.05, {"attention": "explicit"}),  # clipped by the global norm (TP slices summed over the group)
    # 3 heads on TP=2: padded to 4, rank 1's second head zero; the tied embedding/LM head split by vocabulary (41 rows: padded)
    ("gpt", SGD, "eager", 0.0, {"d_model": 24, "n_heads": 3, "vocab_size": 41, "tensor_parallel": {"vocab_parallel_lm_head": True}}),
]


@pytest.mark.distributed
@pytest.mark.slow
@requires_backend("gloo")
def test_tp2_equals_single_process(tmp_path) -> None:
    results = run_distributed_or_fail(train_and_compare, 2, RUNS, str(tmp_path), timeout=600)
    for rank_result in results:
        ckpt = rank_result.pop("checkpoint")
        assert set(ckpt["names"]) <= set(ckpt["consolidated_names"]) and ckpt["consolidated_err"] == 0.0  # zero-to-fp32 joins the slices
        assert ckpt["resume_err"] == 0.0 and ckpt["steps"] == 4  # resumed: weights, AdamW states and counters
        assert ckpt["eval"][0] == pytest.approx(ckpt["eval"][1], rel=1e-5), ckpt["eval"]  # eval mode, two batch sizes
        assert ckpt["held_after_eval"] == 0.0  # the slices the optimizer steps are untouched by the captures
        assert len(rank_result) == len(RUNS)
        for key, r in rank_result.items():
            name = r["name"]
            tol = 1e-5
            uneven = "n_heads" in key  # the 3-head run: split with one zero head padded on rank 1
            assert r["blocks_split"] == 2 * CASES[name]["n_layers"], (key, r["blocks_replicated"])
            assert not r["blocks_replicated"], key
            assert r["losses"] == pytest.approx(r["ref_losses"], rel=tol, abs=1e-6), key
            assert r["grad_err"] < 1e-5, (key, r["grad_err"])
            assert r["param_err"] < tol, (key, r["param_err"])
            if uneven:  # the tied embedding and LM head: one loss and one lookup, split by vocabulary
                assert r["vocab"] == [{"weight": "wte.weight", "vocab": 41, "embeddings": 1}], r["vocab"]
            if uneven:  # attention: 2 of 3 heads' weights per rank (rank 1's second is padding); the MLP and vocabulary: half
                assert 0.5 < r["held_fraction"] < 2 / 3, (key, r["held_fraction"])
            else:
                assert r["held_fraction"] == pytest.approx(0.5), key  # each rank holds half of every split layer
            for norm, ref_norm in r["norms"]:  # the global norm (slices summed over TP), and it really clipped
                assert norm == pytest.approx(ref_norm, rel=1e-5) and ref_norm > r["clip"], (key, norm, ref_norm)


ZERO_STAGES = (0, 1, 2, 3)  # ZeRO shards the TP slices over the DP group
CLIP = 0.05


def tp_times_dp(rank: int, world: int) -> dict[str, Any]:
    """TP=2 × DP=2 (plain, then ZeRO-1, 2 and 3 over the DP group): each DP replica trains on its own batch; the
    steps must equal one process training on both batches, also after an eval-mode batch and a smaller batch."""
    import dscompile
    from dscompile.zoo import build, make_batch

    out: dict[str, Any] = {}
    for zero in ZERO_STAGES:
        case, ref = build("gpt", seed=3, **CASES["gpt"]), build("gpt", seed=3, **CASES["gpt"])
        # clipped by the global norm (each rank's shards, TP slices summed over the TP group); it does clip here
        cfg: dict[str, Any] = {"optimizer": ADAMW, "tensor_parallel": {"autotp_size": 2}, "lower": "eager", "gradient_clipping": CLIP}
        if zero:
            cfg["zero_optimization"] = {"stage": zero}
        engine, optimizer, *_ = dscompile.initialize(model=case.model, config=cfg)
        groups = engine.process_groups
        ref_opt = torch.optim.AdamW(ref.model.parameters(), **ADAMW["params"])
        norms = []
        for step in range(STEPS):
            batches = [make_batch(case, seed=10 * step + dp) for dp in range(groups.dp_size)]
            engine.backward(engine(*batches[groups.dp_rank]))
            engine.step()
            ref_loss = sum(ref.model(*b) for b in batches) / len(batches)
            ref_loss.backward()
            ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.model.parameters(), CLIP))
            norms.append((engine.get_global_grad_norm(), ref_norm))
            ref_opt.step()
            ref_opt.zero_grad()
        full = engine.full_parameters()
        param_err = max(_relative(full[n], p.detach()) for n, p in ref.model.named_parameters())
        # an evaluation loop and a smaller last batch: captured anew (under ZeRO-2/3 wrapped over the same shards)
        small = [tuple(t[:1] for t in make_batch(case, seed=90 + dp)) for dp in range(groups.dp_size)]
        engine.eval()
        ref.model.eval()
        with torch.no_grad():
            eval_err = abs(float(engine(*small[groups.dp_rank])) - float(ref.model(*small[groups.dp_rank])))
        engine.train()
        ref.model.train()
        engine.backward(engine(*small[groups.dp_rank]))
        engine.step()
        (sum(ref.model(*b) for b in small) / len(small)).backward()
        torch.nn.utils.clip_grad_norm_(ref.model.parameters(), CLIP)
        ref_opt.step()
        after = engine.full_parameters()
        out[zero] = {
            "eval_err": eval_err,
            "param_err_after": max(_relative(after[n], p.detach()) for n, p in ref.model.named_parameters()),
            "tp_ranks": groups.tp_ranks,
            "dp_ranks": groups.dp_ranks,
            "dp_world": engine.data_parallel_world_size(),
            "zero_world": engine.zero.world if engine.zero is not None else None,
            "param_err": param_err,
            "same_optimizer": optimizer is engine.optimizer,
            "norms": norms,
        }
    return out


@pytest.mark.distributed
@pytest.mark.slow
@requires_backend("gloo")
def test_tp2_times_dp2_on_4_ranks(four_rank_results: dict[str, list]) -> None:
    results = four_rank_results["tp_times_dp"]
    for zero in ZERO_STAGES:
        rows = [r[zero] for r in results]
        assert [r["tp_ranks"] for r in rows] == [[0, 1], [0, 1], [2, 3], [2, 3]]  # TP innermost
        assert [r["dp_ranks"] for r in rows] == [[0, 2], [1, 3], [0, 2], [1, 3]]
        for r in rows:
            assert r["dp_world"] == 2 and r["zero_world"] == (2 if zero else None)
            # AdamW, 10 steps: the issue allows 1e-3 relative; measured 3e-5, so 2e-4 still catches a weight-decay mismatch (1e-4 a step)
            assert r["param_err"] < 2e-4, (zero, r["param_err"])
            assert r["same_optimizer"], zero  # the optimizer initialize returned is the one stepped (ZeRO moved it in place)
            assert r["eval_err"] < 1e-5 and r["param_err_after"] < 2e-4, (zero, r["eval_err"], r["param_err_after"])
            for step, (norm, ref_norm) in enumerate(r["norms"]):  # after one AdamW step: 1e-3, as the parameters
                assert norm == pytest.approx(ref_norm, rel=1e-5 if step == 0 else 1e-3) and ref_norm > CLIP, (zero, step, norm, ref_norm)


def six_heads_on_four_ranks(rank: int, world: int) -> dict[str, Any]:
    """TP=4 for a Llama with 6 query heads over 3 KV heads (GQA), a 27-unit MLP and a 41-word vocabulary split
    by rows: every split padded (one KV group on ranks 0-2, none on rank 3; MLP units 7/7/7/6), SGD steps
    against the unsplit model on one process."""
    import dscompile
    from dscompile.zoo import build, make_batch

    sizes = {"seq_len": 8, "d_model": 24, "n_heads": 6, "n_kv_heads": 3, "n_layers": 1, "vocab_size": 41, "hidden_dim": 27}
    case, ref = build("llama", seed=3, **sizes), build("llama", seed=3, **sizes)
    cfg = {"optimizer": SGD, "lower": "eager", "tensor_parallel": {"autotp_size": 4, "vocab_parallel_lm_head": True}}
    engine, *_ = dscompile.initialize(model=case.model, config=cfg)
    ref_opt = torch.optim.SGD(ref.model.parameters(), lr=SGD["params"]["lr"])
    loss_err, grad_err = 0.0, 0.0
    for step in range(4):
        batch = make_batch(case, seed=step)
        loss = engine(*batch)
        engine.backward(loss)
        ref_loss = ref.model(*batch)
        ref_loss.backward()
        grads = engine.extension("tensor_parallel").full_gradients()
        grad_err = max(grad_err, *(_relative(grads[n], p.grad) for n, p in ref.model.named_parameters()))
        engine.step()
        ref_opt.step()
        ref_opt.zero_grad()
        loss_err = max(loss_err, abs(float(loss) - float(ref_loss)) / float(ref_loss))
    full = engine.full_parameters()
    plan = engine.extension("tensor_parallel").plan
    return {
        "loss_err": loss_err,
        "grad_err": grad_err,
        "param_err": max(_relative(full[n], p.detach()) for n, p in ref.model.named_parameters()),
        "split": len(plan.split),
        "replicated": plan.replicated,
        "vocab": plan.vocab,
    }


@pytest.mark.distributed
@requires_backend("gloo")
def test_six_heads_train_on_tp4(four_rank_results: dict[str, list]) -> None:
    for r in four_rank_results["six_heads_on_four_ranks"]:
        assert r["split"] == 2 and not r["replicated"], r  # attention and MLP both split, padded
        assert r["vocab"] and r["vocab"][0]["vocab"] == 41, r
        assert r["loss_err"] < 1e-5 and r["grad_err"] < 1e-5 and r["param_err"] < 1e-5, r


def four_rank_checks(rank: int, world: int, checks: list[str]) -> dict[str, Any]:
    """Both 4-rank checks in one spawned group (one start-up of four ranks, not two), each from a clean Dynamo;
    a failing check fails the run, and its traceback names it."""
    out: dict[str, Any] = {}
    for name in checks:
        torch._dynamo.reset()
        try:
            out[name] = globals()[name](rank, world)
        except BaseException as exc:
            exc.add_note(f"in the check {name}")
            raise
    return out


@pytest.fixture(scope="module")
def four_rank_results() -> dict[str, list]:
    """The 4-rank checks of this file, run once for the module; each test asserts on its own check's results."""
    checks = ["tp_times_dp", "six_heads_on_four_ranks"]
    results = run_distributed_or_fail(four_rank_checks, 4, checks, timeout=900)
    return {name: [r[name] for r in results] for name in checks}
