"""The engine core on 2 gloo ranks: ``communication_stats()`` counts what each strategy moves, and
``zero_optimization.allgather_partitions: false`` refreshes parameters by broadcasts with the same result."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dscompile.testing.distributed import requires_backend, run_distributed_or_fail

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

MODEL = {"seq_len": 8, "d_model": 16, "n_heads": 2, "n_layers": 1, "vocab_size": 40, "bias": False}
SGD = {"type": "SGD", "params": {"lr": 0.1}}


def _train(engine: Any, case: Any, rank: int, steps: int) -> None:
    from dscompile.zoo import make_batch

    for step in range(steps):
        engine.backward(engine(*make_batch(case, seed=10 * step + rank)))
        engine.step()


def comm_rank(rank: int, world: int) -> dict[str, Any]:
    import dscompile
    from dscompile.zoo import build, make_batch

    out: dict[str, Any] = {}
    case = build("gpt", seed=3, **MODEL)
    numel = sum(p.numel() for p in case.model.parameters())
    count = sum(1 for p in case.model.parameters() if p.requires_grad)
    engine, *_ = dscompile.initialize(model=case.model, config={"optimizer": SGD, "lower": "eager"})
    _train(engine, case, rank, 2)
    out["dp"] = {"stats": engine.communication_stats(), "numel": numel, "count": count}
    for allgather in (True, False):
        case = build("gpt", seed=3, **MODEL)
        cfg = {"optimizer": SGD, "lower": "eager", "gradient_clipping": 1.0, "zero_optimization": {"stage": 1, "allgather_partitions": allgather}}
        engine, *_ = dscompile.initialize(model=case.model, config=cfg)
        _train(engine, case, rank, 2)
        padded = sum(layout.shard_numel * world for layout in engine.zero.layouts)
        out[("zero1", allgather)] = {"stats": engine.communication_stats(), "padded": padded, "params": engine.full_parameters()}
    case = build("gpt", seed=3, **MODEL)
    cfg = {"optimizer": SGD, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}  # default lowering: Inductor
    engine, *_ = dscompile.initialize(model=case.model, config=cfg)
    loss = engine(*make_batch(case, seed=rank))
    after_forward = engine.communication_stats()
    engine.backward(loss)
    engine.step()
    out["zero3"] = {
        "after_forward": after_forward,
        "after_step": engine.communication_stats(),
        "padded": sum(layout.shard_numel * world for layout in engine.zero.layouts),
    }
    return out


@requires_backend("gloo")
def test_communication_stats_and_allgather_partitions() -> None:
    results = run_distributed_or_fail(comm_rank, 2, timeout=400)
    for result in results:
        dp = result["dp"]
        # one flat fp32 all-reduce of every gradient per optimizer step, timed, with one has-a-gradient flag per parameter
        assert dp["stats"]["data_parallel"]["all_reduce"]["calls"] == 2
        assert dp["stats"]["data_parallel"]["all_reduce"]["bytes"] == 2 * 4 * (dp["numel"] + dp["count"])
        assert dp["stats"]["data_parallel"]["all_reduce"]["seconds"] > 0
        for allgather in (True, False):
            z1 = result[("zero1", allgather)]
            zero = z1["stats"]["zero"]
            assert zero["reduce_scatter"] == {"calls": 2, "bytes": 2 * 4 * z1["padded"], "seconds": zero["reduce_scatter"]["seconds"]}
            refresh = "all_gather" if allgather else "broadcast"  # DeepSpeed's allgather_partitions: false
            assert set(zero) == {"reduce_scatter", refresh, "clip_norm.all_reduce"}
            assert zero["clip_norm.all_reduce"]["calls"] == 2 and zero["clip_norm.all_reduce"]["bytes"] == 2 * 4  # one fp32 norm² a step
            assert zero[refresh]["calls"] == 2 and zero[refresh]["bytes"] == 2 * 4 * z1["padded"]
        same = result[("zero1", True)]["params"], result[("zero1", False)]["params"]
        torch.testing.assert_close(same[0], same[1], rtol=0, atol=0)
        z3 = result["zero3"]
        padded_bytes = 4 * z3["padded"]
        # in the compiled graphs: forward gathers every parameter once; backward reduce-scatters every gradient and, within
        # DeepSpeed's default stage3_max_reuse_distance (1e9 elements: all of this model), gathers nothing again
        assert z3["after_forward"] == {"in_graph": {"all_gather": {"calls": z3["after_forward"]["in_graph"]["all_gather"]["calls"], "bytes": padded_bytes}}}
        graph = z3["after_step"]["in_graph"]
        assert graph["reduce_scatter"]["bytes"] == padded_bytes
        assert graph["all_gather"]["bytes"] == padded_bytes
        # nothing is kept whole, so no refresh after the step; only the global norm (compute_grad_norm, DeepSpeed's default)
        norm = z3["after_step"]["zero"]["clip_norm.all_reduce"]
        assert z3["after_step"]["zero"] == {"clip_norm.all_reduce": {"calls": 1, "bytes": 4, "seconds": norm["seconds"]}}
