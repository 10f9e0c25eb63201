"""Ulysses sequence parallelism found from the graph (``passes/sequence_parallel.py``) on 2 gloo ranks.

Each model trains with ``sequence_parallel_size: 2`` and on a single process from the same weights and
batches: the losses and every parameter's update after SGD steps must agree (fp32: 1e-5 relative on
losses, 1e-4 on updates, which are gradients times the learning rate). Sequence lengths 2 divides and
does not (padded), GQA (the zoo Llama: 4 query heads, 2 KV heads), Hugging Face GPT-2 and Llama built
from configs under the default lowering (Inductor) and ZeRO-2/3 over both ranks. Every attention must run
with Ulysses' all-to-alls and the loss must be summed over the chunks, with nothing gathered whole; attention
written out as ``softmax(q k^T) v`` runs on the query chunk with the keys and values gathered.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dscompile.errors import DSCompileConfigError
from dscompile.testing.distributed import requires_backend, run_distributed_or_fail

SIZES: dict[str, dict[str, Any]] = {
    "gpt": {"d_model": 16, "n_heads": 2, "n_layers": 2, "vocab_size": 40},
    "gpt_explicit": {"d_model": 16, "n_heads": 2, "n_layers": 2, "vocab_size": 40},
    "llama": {"d_model": 16, "n_heads": 4, "n_kv_heads": 2, "n_layers": 2, "vocab_size": 40, "hidden_dim": 32},
    "hf_gpt2": {"hidden": 16, "n_heads": 2, "n_layers": 2, "vocab_size": 40},
    "hf_llama": {"hidden": 16, "n_heads": 2, "n_layers": 2, "vocab_size": 40},
}
RUNS: list[tuple[str, int, dict[str, Any]]] = [
    ("gpt", 8, {"lower": "eager"}),
    ("llama", 7, {"lower": "eager"}),  # GQA; 7 tokens: padded to 8
    ("gpt_explicit", 7, {"lower": "eager"}),  # softmax(q k^T) v written out: keys and values gathered
    ("hf_gpt2", 8, {"zero_optimization": {"stage": 2}}),  # the default lowering
    ("hf_llama", 7, {"zero_optimization": {"stage": 3}}),
]
STEPS = 3
LR = 0.1


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _step_both(engine: Any, reference: torch.nn.Module, ref_opt: torch.optim.Optimizer, batch: tuple) -> tuple[float, float]:
    """One training step of the engine and of the single-process reference on the same batch: both losses."""
    loss = engine(*batch)
    engine.backward(loss)
    engine.step()
    ref_loss = reference(*batch)
    ref_loss.backward()
    ref_opt.step()
    ref_opt.zero_grad()
    return float(loss), float(ref_loss)


def several_checks(rank: int, world: int, checks: list[tuple[str, tuple]]) -> dict[str, Any]:
    """Run several of this file's 2-rank checks in one spawned group (one start-up of the ranks, not four), each from
    a clean Dynamo; a failing check fails the run, and its traceback names it."""
    out: dict[str, Any] = {}
    for name, args in checks:
        torch._dynamo.reset()
        try:
            out[name] = globals()[name](rank, world, *args)
        except BaseException as exc:
            exc.add_note(f"in the check {name}")
            raise
    return out


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The 2-rank checks of this file, run once for the module; each test asserts on its own check's results."""
    save_dir = tmp_path_factory.mktemp("sp_checkpoint")
    checks = [
        ("train_against_single_process", ()),
        ("lengths_and_modes", ()),
        ("checkpoint_round_trip", (str(save_dir),)),
        ("sparse_attention_losses", ()),
    ]
    results = run_distributed_or_fail(several_checks, 2, checks, timeout=900)
    return {"save_dir": save_dir, **{name: [r[name] for r in results] for name, _ in checks}}


def train_against_single_process(rank: int, world: int) -> dict[str, Any]:
    import copy

    import dscompile
    from dscompile.zoo import build, make_batch

    out: dict[str, Any] = {}
    for name, seq, extra in RUNS:
        case = build(name, seed=3, seq_len=seq, batch_size=2, **SIZES[name])
        reference = copy.deepcopy(case.model)
        before = {n: p.detach().clone() for n, p in reference.named_parameters()}
        config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": LR}}, "sequence_parallel_size": 2, **extra}
        engine, *_ = dscompile.initialize(model=case.model, config=config)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
        loss_err = 0.0
        for step in range(STEPS):
            loss, ref_loss = _step_both(engine, reference, ref_opt, make_batch(case, seed=10 + step))
            loss_err = max(loss_err, abs(loss - ref_loss) / abs(ref_loss))
        full = engine.full_parameters()
        update_err = {n: _relative(full[n] - before[n], p.detach() - before[n]) for n, p in reference.named_parameters()}
        plan = engine.extension("sequence_parallel").plan
        out[name] = {
            "loss_err": loss_err,
            "update_err": max(update_err.values()),
            "worst": max(update_err, key=update_err.get),
            "ulysses": len(plan.ulysses),
            "gathered": [g["reason"] for g in plan.gathered],
            "chunked_losses": len(plan.chunked_losses),
            "padded": plan.padded,
            "train_batch_size": engine.train_batch_size(),
        }
    return out


@pytest.mark.distributed
@pytest.mark.slow
@requires_backend("gloo")
def test_sequence_parallel_trains_like_one_process(two_rank_results: dict[str, Any]) -> None:
    results = two_rank_results["train_against_single_process"]
    for name, seq, _ in RUNS:
        for rank, result in enumerate(results):
            r = result[name]
            assert r["loss_err"] < 1e-5, (name, rank, r)
            assert r["update_err"] < 1e-4, (name, rank, r)
            layers = SIZES[name]["n_layers"]
            assert r["chunked_losses"] == 1, (name, r)  # the loss summed over chunks: the logits never gathered
            if name == "gpt_explicit":  # per layer: the keys for q k^T, the values for the product with them
                assert r["ulysses"] == 0 and len(r["gathered"]) == 2 * layers, (name, r)
                assert all("needs every key" in g for g in r["gathered"]), r
            else:
                assert r["ulysses"] == layers and r["gathered"] == [], (name, r)  # every attention split by heads
            assert r["padded"] == (seq % 2 != 0)
            assert r["train_batch_size"] == 2  # both ranks are one data-parallel replica


def test_the_torch_compile_backend_refuses_sequence_parallelism() -> None:
    model = torch.nn.Linear(4, 4)
    compiled = torch.compile(model, backend="dscompile", options={"sequence_parallel_size": 2, "lower": "eager"})
    with pytest.raises(Exception, match="sequence_parallel_size"):
        compiled(torch.randn(2, 4))


def test_sequence_parallel_needs_a_world_it_divides() -> None:
    import dscompile
    from dscompile.zoo import build

    case = build("gpt", seed=0, seq_len=8, **SIZES["gpt"])
    with pytest.raises(DSCompileConfigError, match="sequence_parallel_size': the world size 1 is not a multiple of 2"):
        config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "sequence_parallel_size": 2}
        dscompile.initialize(model=case.model, config=config)


def test_sequence_parallel_gradients_in_another_dtype_are_refused_by_name() -> None:
    from dscompile.config import load_config

    with pytest.raises(DSCompileConfigError, match="seq_parallel_communication_data_type"):
        load_config({"sequence_parallel_size": 2, "seq_parallel_communication_data_type": "bf16"})
    load_config({"sequence_parallel_size": 2, "seq_parallel_communication_data_type": "fp32"})


def two_groups_of_two(rank: int, world: int) -> dict[str, Any]:
    """SP=2 × DP=2, ZeRO-2 over all four ranks: each group trains on its own batch (both ranks of a group
    pass it; the engine broadcasts the group's first rank's anyway); the update is the one of the mean
    loss over both batches on one process."""
    import copy

    import dscompile
    from dscompile.zoo import build, make_batch

    case = build("hf_llama", seed=3, seq_len=7, batch_size=2, **SIZES["hf_llama"])
    reference = copy.deepcopy(case.model)
    before = {n: p.detach().clone() for n, p in reference.named_parameters()}
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": LR}}, "sequence_parallel_size": 2,
              "lower": "eager", "zero_optimization": {"stage": 2}}  # fmt: skip
    engine, *_ = dscompile.initialize(model=case.model, config=config)
    batches = [make_batch(case, seed=20 + group) for group in range(2)]
    engine.backward(engine(*batches[rank // 2]))
    engine.step()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    (sum(reference(*b) for b in batches) / 2).backward()
    ref_opt.step()
    full = engine.full_parameters()
    errs = {n: _relative(full[n] - before[n], p.detach() - before[n]) for n, p in reference.named_parameters()}
    return {"update_err": max(errs.values()), "train_batch_size": engine.train_batch_size()}


@pytest.mark.distributed
@requires_backend("gloo")
def test_sequence_parallel_composes_with_data_parallel_zero_on_four_ranks() -> None:
    for result in run_distributed_or_fail(two_groups_of_two, 4, timeout=300):
        assert result["update_err"] < 1e-4, result
        assert result["train_batch_size"] == 4  # two data-parallel replicas of micro-batch 2


def checkpoint_round_trip(rank: int, world: int, save_dir: str) -> float:
    """Save under SP=2 + ZeRO-2, load into an engine built from other weights, train both one more step (the
    first engine also dumps: its plan is written as JSON)."""
    import dscompile
    from dscompile.zoo import build, make_batch

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "sequence_parallel_size": 2,
              "lower": "eager", "zero_optimization": {"stage": 2}}  # fmt: skip
    engines = []
    for seed in (3, 4):
        case = build("hf_llama", seed=seed, seq_len=7, batch_size=2, **SIZES["hf_llama"])
        dump = {"dump": f"{save_dir}/dump"} if not engines else {}
        engines.append(dscompile.initialize(model=case.model, config={**config, **dump})[0])
    first, second = engines
    for step in range(2):
        first.backward(first(*make_batch(case, seed=step)))
        first.step()
    first.save_checkpoint(save_dir, tag="t")
    second(*make_batch(case, seed=0))  # captured and rewritten at its first batch, then loaded
    second.load_checkpoint(save_dir, tag="t")
    for engine in engines:
        engine.backward(engine(*make_batch(case, seed=9)))
        engine.step()
    a, b = first.full_parameters(), second.full_parameters()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


@pytest.mark.distributed
@requires_backend("gloo")
def test_sequence_parallel_checkpoints_resume_exactly(two_rank_results: dict[str, Any]) -> None:
    import json

    assert two_rank_results["checkpoint_round_trip"] == [0.0, 0.0]
    plan = json.loads((two_rank_results["save_dir"] / "dump" / "sequence_parallel_plan_7.json").read_text())
    assert plan["sp_size"] == 2 and plan["chunk"] == 4 and len(plan["ulysses"]) == 2 and plan["chunked_losses"], plan


SPARSE = {"mode": "fixed", "block": 8, "num_local_blocks": 2, "num_global_blocks": 1, "attention": "unidirectional"}


def sparse_attention_losses(rank: int, world: int) -> tuple[float, float, float]:
    """SP=2 with the sparse_attention section: the block-sparse op runs on each rank's heads over the whole
    sequence; the loss is the single-process sparse model's (and not the dense one's)."""
    import copy

    import dscompile
    from dscompile.zoo import build, make_batch

    case = build("gpt", seed=3, seq_len=32, batch_size=2, **SIZES["gpt"])
    sparse_reference = torch.compile(copy.deepcopy(case.model), backend="dscompile", options={"sparse_attention": SPARSE, "lower": "eager"})
    dense = copy.deepcopy(case.model)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": LR}}, "sequence_parallel_size": 2,
              "lower": "eager", "sparse_attention": SPARSE}  # fmt: skip
    engine, *_ = dscompile.initialize(model=case.model, config=config)
    batch = make_batch(case, seed=1)
    return float(engine(*batch)), float(sparse_reference(*batch)), float(dense(*batch))


@pytest.mark.distributed
@requires_backend("gloo")
def test_sequence_parallel_composes_with_sparse_attention(two_rank_results: dict[str, Any]) -> None:
    for ours, sparse, dense in two_rank_results["sparse_attention_losses"]:
        assert abs(ours - sparse) <= 1e-5 * abs(sparse), (ours, sparse)
        assert abs(ours - dense) > 1e-5, "the sparse layout was not applied"


def test_a_layout_per_head_is_refused_under_sequence_parallelism() -> None:
    from dscompile.config import load_config
    from dscompile.passes.sequence_parallel import SequenceParallelExtension
    from dscompile.runtime.engine_context import EngineContext

    class Engine:  # what configure reads of an engine
        config = load_config({"sequence_parallel_size": 2, "sparse_attention": {**SPARSE, "different_layout_per_head": True}})
        runs_pipeline = False
        module = torch.nn.Linear(2, 2)
        context = EngineContext()

    with pytest.raises(DSCompileConfigError, match="different_layout_per_head"):
        SequenceParallelExtension(2).configure(Engine())  # type: ignore[arg-type]


def lengths_and_modes(rank: int, world: int) -> dict[str, Any]:
    """Batches of 8, then 5 tokens, then 8 again, then eval: each new shape or mode is captured and rewritten anew
    (the parameters are untouched), also under ZeRO-2 and ZeRO-3, whose ops wrap each new graph over the same
    shards (ZeRO-3 gathers the parameters for the capture only)."""
    import copy

    import dscompile
    from dscompile.zoo import build, make_batch

    out: dict[str, Any] = {}
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": LR}}, "sequence_parallel_size": 2, "lower": "eager"}
    # one layer: each capture is what this checks (every layer's attention split: test_sequence_parallel_trains_like_one_process)
    sizes = SIZES["gpt"] | {"n_layers": 1}
    cases = {seq: build("gpt", seed=3, seq_len=seq, batch_size=2, **sizes) for seq in (8, 5)}
    for stage in (0, 2, 3):
        model = copy.deepcopy(cases[8].model)
        reference = copy.deepcopy(model)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
        engine, *_ = dscompile.initialize(model=model, config={**config, "zero_optimization": {"stage": stage}})
        errs = []
        for seq in (8, 5, 8):
            loss, ref_loss = _step_both(engine, reference, ref_opt, make_batch(cases[seq], seed=seq))
            errs.append(abs(loss - ref_loss))
        engine.eval()
        reference.eval()
        batch = make_batch(cases[5], seed=1)
        with torch.no_grad():
            errs.append(abs(float(engine(*batch)) - float(reference(*batch))))
        out[stage] = errs
    return out


@pytest.mark.distributed
@requires_backend("gloo")
def test_sequence_parallel_captures_each_new_length_and_mode(two_rank_results: dict[str, Any]) -> None:
    for result in two_rank_results["lengths_and_modes"]:
        for stage, errs in result.items():
            assert len(errs) == 4 and max(errs) < 1e-5, (stage, errs)
