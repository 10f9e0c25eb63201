"""The inference engine on the engine core (``dscompile.runtime.engine_core``): its plan is the planner's
(``plan_inference``: tensor parallelism × data parallelism), inference extensions configure it, ``communication_stats()``
counts its graphs' collectives, ``destroy()`` releases it; on one process and under TP=2 (2 gloo ranks).
Its numerics are test_inference*.py's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import dscompile
from dscompile.errors import DSCompileConfigError
from dscompile.planner import ParallelLayout, plan_inference
from dscompile.runtime import engine_extension
from dscompile.runtime.engine_core import INFERENCE, EngineExtension, register_engine_extension
from dscompile.testing.distributed import requires_backend, run_distributed_or_fail

pytest.importorskip("transformers")


def test_plan_inference_lays_out_tensor_then_data_parallelism() -> None:
    plan = plan_inference(4, 2)
    assert plan.layout == ParallelLayout(4, 2, 1) and plan.layout.dp_size == 2
    assert plan.layout.tp_groups() == [[0, 1], [2, 3]] and plan.layout.dp_groups() == [[0, 2], [1, 3]]
    assert plan.zero_stage == 0 and plan.offload_optimizer == plan.offload_param == "none"
    text = plan.text()  # says what an inference plan is, not a training plan's ZeRO and offload lines
    assert text.startswith("inference plan: world 4 = data 2 (independent model copies) × tensor 2")
    assert "tensor groups: [[0, 1], [2, 3]]" in text and "ZeRO stage" not in text and "offload:" not in text
    for world, tp in ((3, 2), (1, 2), (4, 0)):
        with pytest.raises(DSCompileConfigError, match=rf"tensor_parallel\.tp_size.*{tp} ranks per model do not divide the world of {world}"):
            plan_inference(world, tp)


class _Probe(EngineExtension):
    """An inference extension: records the core's hooks and reports a counter."""

    name = "probe"

    def __init__(self, config: Any) -> None:
        self.config = config
        self.calls: list[str] = []

    def configure(self, engine: Any) -> None:
        self.calls.append("configure")

    def counters(self) -> dict[str, Any]:
        return {"configured": self.calls.count("configure")}

    def destroy(self, engine: Any) -> None:
        self.calls.append("destroy")


@pytest.fixture
def probe_registered() -> Any:
    saved, kinds = list(engine_extension._FACTORIES), dict(engine_extension._KINDS)

    @register_engine_extension(50, "probe", kind=INFERENCE)
    def _probe(config: Any) -> _Probe:
        return _Probe(config)

    yield
    engine_extension._FACTORIES[:] = saved
    engine_extension._KINDS.clear()
    engine_extension._KINDS.update(kinds)


def test_one_process_engine_has_the_core(probe_registered: Any, tmp_path: Path) -> None:
    from test_inference import left_padded_batch, tiny

    model, reference = tiny("llama"), tiny("llama")
    ids, mask = left_padded_batch()
    engine = dscompile.init_inference(model, dtype=torch.float32, max_out_tokens=32, lower="eager", dump=str(tmp_path))
    assert engine.plan.layout == ParallelLayout(1, 1, 1)
    assert (engine.world_size, engine.global_rank, engine.rank, engine.local_rank) == (1, 0, 0, 0)
    assert engine.config is model.config and engine._config.max_out_tokens == 32  # DeepSpeed's two names
    assert "inference plan: world 1 = data 1 (independent model copies) × tensor 1" in (tmp_path / "plan.txt").read_text()
    probe = engine.extension("probe")
    assert isinstance(probe, _Probe) and probe.calls == ["configure"] and probe.config is engine._config
    with torch.no_grad():
        assert torch.allclose(engine(ids, attention_mask=mask).logits, reference(ids, attention_mask=mask).logits, atol=1e-5, rtol=0)
    assert engine.communication_stats() == {"extensions": {"probe": {"configured": 1}}}  # one process: no collectives
    engine.destroy()
    engine.destroy()  # idempotent
    assert probe.calls == ["configure", "destroy"]
    with pytest.raises(RuntimeError, match="destroyed"):
        engine(ids)
    with pytest.raises(RuntimeError, match="destroyed"):
        engine.generate(ids, max_new_tokens=2)


def test_training_engines_do_not_build_inference_extensions(probe_registered: Any) -> None:
    engine, *_ = dscompile.initialize(model=torch.nn.Linear(4, 2), config={"train_micro_batch_size_per_gpu": 1, "lower": "eager"})
    assert engine.extension("probe") is None and engine.config is engine._config


def test_tp_size_that_does_not_divide_the_world_is_refused_by_the_plan() -> None:
    from test_inference import tiny

    with pytest.raises(DSCompileConfigError, match=r"tensor_parallel\.tp_size.*2 ranks per model do not divide the world of 1 process"):
        dscompile.init_inference(tiny("llama"), dtype=torch.float32, lower="eager", tensor_parallel={"tp_size": 2})


def tp2_engine(rank: int, world: int, dump: str) -> dict[str, Any]:
    from test_inference import left_padded_batch, tiny

    model, reference = tiny("llama"), tiny("llama")
    ids, mask = left_padded_batch()
    engine = dscompile.init_inference(model, dtype=torch.float32, max_out_tokens=32, lower="eager", tensor_parallel={"tp_size": 2}, dump=dump)
    with torch.no_grad():
        err = float((engine(ids, attention_mask=mask).logits - reference(ids, attention_mask=mask).logits).abs().max())
    stats = engine.communication_stats()
    engine.destroy()
    try:
        engine(ids)
        after = "ran"
    except RuntimeError as exc:
        after = str(exc)
    return {
        "layout": engine.plan.layout,
        "tp_groups": engine.plan.layout.tp_groups(),
        "ranks": (engine.world_size, engine.global_rank),
        "err": err,
        "all_reduces": stats.get("in_graph", {}).get("all_reduce", {}).get("calls", 0),
        "after_destroy": after,
    }


@requires_backend("gloo")
@pytest.mark.distributed
def test_tp2_engine_plan_stats_and_destroy(tmp_path: Path) -> None:
    results = run_distributed_or_fail(tp2_engine, 2, str(tmp_path), timeout=300)
    for rank, r in enumerate(results):
        assert r["layout"] == ParallelLayout(2, 2, 1) and r["tp_groups"] == [[0, 1]] and r["ranks"] == (2, rank), r
        assert r["err"] <= 1e-5, r
        assert r["all_reduces"] > 0, r  # the split graph's all-reduces, counted while the engine ran it
        assert "destroyed" in r["after_destroy"], r
    assert "tensor groups: [[0, 1]]" in (tmp_path / "plan.txt").read_text()
