"""DeepSpeed's AutoTP training API: ``set_autotp_mode``, ``tp_model_init``, ``deepspeed.utils.groups`` and
``initialize(mpu=...)`` together with ``tensor_parallel`` (DeepSpeed's AutoTP example and Hugging Face's
Trainer call them), with only the import swapped.

Two gloo ranks train a Hugging Face Llama (built from a config) for 2 SGD steps at TP=2, the intent given
each way a DeepSpeed script gives it: ``tp_model_init`` alone (no ``tensor_parallel`` in the config), and the
config's ``autotp_size`` with an ``mpu`` naming the script's own TP-innermost groups. Losses equal one
process; the attention and MLP blocks are split. The merge rules (the config wins, a mismatch is an error)
are checked on one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

import dscompile as deepspeed
from dscompile.testing.distributed import requires_backend, run_distributed_or_fail

transformers = pytest.importorskip("transformers")


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, vocab_size=50, max_position_embeddings=16
    )
    return transformers.LlamaForCausalLM(config)


@dataclass
class ModelParallelUnit:
    """The unit DeepSpeed's AutoTP example builds from its own groups."""

    tp_group: Any
    dp_group: Any

    def get_model_parallel_group(self) -> Any:
        return self.tp_group

    def get_data_parallel_group(self) -> Any:
        return self.dp_group


def _ported_script(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from dscompile.module_inject.layers import set_autotp_mode
    from dscompile.utils import groups

    batches = [torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    reference = _llama()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected = []
    for ids in batches:
        loss = reference(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(float(loss))
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "lower": "eager"}
    out: dict[str, Any] = {"expected": expected}
    for way in ("tp_model_init", "mpu"):
        set_autotp_mode(training=True)
        model = _llama()
        if way == "tp_model_init":
            model = deepspeed.tp_model_init(model, tp_size=2, dtype=torch.float32)
            tp_world = groups.get_tensor_model_parallel_world_size()  # laid out right away, as DeepSpeed's
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        else:
            tp_group, dp_groups = dist.new_group([0, 1]), [dist.new_group([r]) for r in range(world)]
            mpu = ModelParallelUnit(tp_group, dp_groups[rank])
            engine, *_ = deepspeed.initialize(model=model, config=config | {"tensor_parallel": {"autotp_size": 2}}, mpu=mpu)
            tp_world = groups.get_tensor_model_parallel_world_size()
        losses = []
        for ids in batches:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        plan = engine.extension("tensor_parallel").plan
        dp_world = groups.get_data_parallel_world_size()
        out[way] = {"losses": losses, "tp_world": tp_world, "split": len(plan.split), "replicated": plan.replicated, "dp": dp_world}
    return out


@pytest.mark.distributed
@requires_backend("gloo")
def test_autotp_scripts_port_with_the_import_swapped() -> None:
    for r in run_distributed_or_fail(_ported_script, 2, timeout=600):
        for way in ("tp_model_init", "mpu"):
            row = r[way]
            assert row["losses"] == pytest.approx(r["expected"], rel=1e-5), (way, row)
            assert row["tp_world"] == 2 and row["dp"] == 1, (way, row)
            assert row["split"] == 4 and not row["replicated"], (way, row)


def test_tp_model_init_merges_with_the_config_as_deepspeed_does() -> None:
    from dscompile.autotp import merge_autotp_intent
    from dscompile.config import load_config

    model = deepspeed.tp_model_init(_llama(), tp_size=2, dtype=torch.bfloat16)
    assert deepspeed.module_inject.layers.is_autotp_training_mode()
    merged, _ = merge_autotp_intent(model, load_config({"bf16": {"enabled": True}}), None)  # filled from the record
    assert merged.sections["tensor_parallel"].autotp_size == 2
    with pytest.raises(deepspeed.DSCompileConfigError, match="tensor_parallel.autotp_size"):
        merge_autotp_intent(model, load_config({"bf16": {"enabled": True}, "tensor_parallel": {"autotp_size": 4}}), None)
    with pytest.raises(deepspeed.DSCompileConfigError, match="bf16"):  # the record says bf16, the config trains in fp32
        merge_autotp_intent(model, load_config({}), None)
    with pytest.raises(deepspeed.DSCompileConfigError, match="tensor_parallel.autotp_size"):  # checked at the call when given the config
        deepspeed.tp_model_init(_llama(), tp_size=2, dtype=torch.float32, config={"tensor_parallel": {"autotp_size": 4}})
    with pytest.raises(deepspeed.DSCompileNotSupportedError, match="partition_config"):
        deepspeed.tp_model_init(_llama(), tp_size=2, dtype=torch.float32, partition_config={})
