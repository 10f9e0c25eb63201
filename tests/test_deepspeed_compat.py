"""DeepSpeed's module-level names, one process: accelerator, arguments, utils, checkpointing, pipe, moe,
and the pipeline stage runner's handling of inputs a stage modifies in place."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import dscompile
import dscompile as deepspeed
from dscompile.engines.pipeline_parallel import GraphStageRunner, PipelineEngine
from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError

warnings.filterwarnings("ignore", message="Failed to fetch module")


# -- accelerator -----------------------------------------------------------------------------
def test_accelerator_on_the_host():
    acc = deepspeed.get_accelerator()
    assert acc is deepspeed.accelerator.get_accelerator()  # one per process
    assert (acc.device_name(), acc.device_name(1), acc.current_device_name()) == ("cpu", "cpu", "cpu")
    assert acc.communication_backend_name() == "gloo" and acc.is_available()
    assert acc.is_bf16_supported() and acc.is_fp16_supported()
    assert torch.bfloat16 in acc.supported_dtypes()
    assert acc.current_device() == int(os.environ.get("LOCAL_RANK", 0)) and acc.device_count() >= 1
    acc.set_device(0)
    acc.synchronize()
    acc.empty_cache()
    acc.reset_peak_memory_stats()
    used = acc.memory_allocated()
    big = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB touched: the resident set grows
    assert acc.max_memory_allocated() >= acc.memory_allocated() >= used + (32 << 20)
    del big
    assert acc.total_memory() > acc.available_memory() > 0
    acc.manual_seed(3)
    a = torch.rand(3)
    acc.random().manual_seed(3)
    assert torch.equal(a, torch.rand(3))
    state = acc.get_rng_state()
    b = torch.rand(2)
    acc.set_rng_state(state)
    assert torch.equal(b, torch.rand(2))
    t = torch.zeros(2)
    assert acc.on_accelerator(t) and acc.pin_memory(t) is t
    with acc.stream(acc.Stream()):
        pass
    assert acc.Event is None
    assert acc.FloatTensor([1.0]).dtype == torch.float32 and acc.BFloat16Tensor([1.0]).dtype == torch.bfloat16
    with pytest.raises(DSCompileNotSupportedError, match="op builders"):
        acc.create_op_builder("FusedAdamBuilder")


# -- module-level functions ------------------------------------------------------------------
def test_add_config_arguments_and_initialize_reads_args(tmp_path):
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    path = tmp_path / "ds_config.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "lower": "eager"}')
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    assert args.deepspeed and args.deepspeed_config == str(path)
    engine, optimizer, _, _ = deepspeed.initialize(args=args, model=nn.Linear(3, 1))
    assert isinstance(optimizer, torch.optim.SGD) and engine.config.train_micro_batch_size_per_gpu == 2
    old = parser.parse_args(["--deepscale_config", str(path)])  # DeepSpeed's deprecated spelling
    assert deepspeed.initialize(args=old, model=nn.Linear(3, 1))[1] is not None
    with pytest.raises(DSCompileConfigError, match="given both"):
        deepspeed.initialize(args=args, model=nn.Linear(3, 1), config={"train_micro_batch_size_per_gpu": 2})


def test_comm_without_a_process_group():
    assert (deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()) == (0, 1)
    assert not deepspeed.comm.is_initialized() and deepspeed.comm.is_available()
    with pytest.raises(DSCompileNotSupportedError, match="prof=True"):
        deepspeed.comm.barrier(prof=True)
    with pytest.raises(TypeError, match="unexpected keyword"):
        deepspeed.comm.barrier(profile=True)
    with pytest.raises(DSCompileConfigError, match="dist_init_required"):
        deepspeed.init_distributed(dist_init_required=False)


def test_repeating_loader_and_seed():
    from dscompile.runtime.utils import set_random_seed

    loader = deepspeed.utils.RepeatingLoader([1, 2, 3])
    assert [next(loader) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]
    with pytest.raises(StopIteration):
        next(deepspeed.utils.RepeatingLoader([]))
    set_random_seed(5)
    a = torch.rand(2)
    set_random_seed(5)
    assert torch.equal(a, torch.rand(2))


def test_moe_is_importable_and_refused():
    from dscompile.moe.layer import MoE
    from dscompile.moe.utils import split_params_into_different_moe_groups_for_optimizer

    groups = [{"params": [nn.Parameter(torch.zeros(1))]}]
    assert split_params_into_different_moe_groups_for_optimizer(groups) is groups
    with pytest.raises(DSCompileNotSupportedError, match="Mixture-of-Experts"):
        MoE(hidden_size=8, expert=nn.Linear(8, 8), num_experts=2)


_INIT_UNDER_A_LAUNCHER = """
import torch.distributed as dist
from torch import nn
import dscompile as deepspeed
assert not dist.is_initialized()
with deepspeed.zero.Init():
    layer = nn.Linear(4, 2)
assert dist.is_initialized() and dist.get_world_size() == 1
assert layer.weight.ds_shape == (2, 4) and layer.weight.ds_numel == 8 and layer.weight.numel() == 0
print("ok")
"""


def test_zero_init_starts_the_process_group_as_deepspeeds_does():
    """DeepSpeed's ``zero.Init`` calls ``init_distributed`` when no process group exists (scripts such as
    DeepSpeedExamples' offload_states.py build their model under it first thing): the launcher's environment (here
    torchrun's for one process) gives the group. In a fresh interpreter, so this process makes no group."""
    from dscompile.testing.distributed import free_port

    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    proc = subprocess.run([sys.executable, "-c", _INIT_UNDER_A_LAUNCHER], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_zero_init_disabled_and_mics():
    with deepspeed.zero.Init(enabled=False):
        assert nn.Linear(2, 2).weight.numel() == 4
    with pytest.raises(DSCompileNotSupportedError, match="MiCS"):
        deepspeed.zero.MiCS_Init()


# -- checkpointing ---------------------------------------------------------------------------
class _Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

    def block(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return torch.tanh(self.a(x)) * scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(deepspeed.checkpointing.checkpoint(self.block, x, scale=2.0)).pow(2).mean()


@pytest.mark.parametrize("compiled", [False, True])
def test_checkpoint_gives_the_gradients_of_the_plain_model(compiled):
    """Eager and inside the dscompile backend (default lowering), with DeepSpeed's configure call."""
    deepspeed.checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"partition_activations": True, "number_checkpoints": 2}})
    assert deepspeed.checkpointing.is_configured()
    torch.manual_seed(0)
    model, ref = _Checkpointed(), _Checkpointed()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(4, 8)
    run = torch.compile(model, backend="dscompile") if compiled else model
    run(x).backward()
    ref.b(ref.block(x, 2.0)).pow(2).mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    deepspeed.checkpointing.reset()
    assert not deepspeed.checkpointing.is_configured()


def test_checkpointing_configure_refusals():
    with pytest.raises(DSCompileNotSupportedError, match="mpu_"):
        deepspeed.checkpointing.configure(object())
    with pytest.raises(DSCompileNotSupportedError, match="contiguous"):
        deepspeed.checkpointing.configure(None, contiguous_checkpointing=True)
    with pytest.raises(DSCompileNotSupportedError, match="profile"):
        deepspeed.checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"profile": True}})


# -- pipe ------------------------------------------------------------------------------------
class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


def _layers() -> list:
    from dscompile.pipe import LayerSpec

    return [LayerSpec(nn.Linear, 4, 16), LayerSpec(_Block, 16), nn.ReLU(), LayerSpec(_Block, 16), lambda x: x * 0.5, LayerSpec(nn.Linear, 16, 3)]


def test_pipeline_module_partitions_by_its_method():
    from dscompile.pipe import PipeDataParallelTopology, PipelineModule

    torch.manual_seed(0)
    pm = PipelineModule(_layers(), num_stages=2, partition_method="parameters")
    assert [n for n, _ in pm.named_parameters()][:2] == ["0.weight", "0.bias"]  # DeepSpeed's names: layer index first
    assert pm.partitions() in ([0, 2, 6], [0, 3, 6])  # 80 + 272 | 272 + 51 trainable parameters (ReLU has none)
    assert PipelineModule(_layers(), num_stages=3, partition_method="uniform").partitions() == [0, 2, 4, 6]
    assert PipelineModule(_layers(), num_stages=2, partition_method="type:_block").partitions()[1] in (2, 3)
    assert PipelineModule(_layers(), topology=PipeDataParallelTopology(num_pp=2, num_dp=1)).num_stages == 2
    with pytest.raises(DSCompileConfigError, match="no layer class matches"):
        PipelineModule(_layers(), num_stages=2, partition_method="type:Conv")
    with pytest.raises(DSCompileNotSupportedError, match="partition methods"):
        PipelineModule(_layers(), num_stages=2, partition_method="profile")
    with pytest.raises(DSCompileConfigError, match="num_stages or topology"):
        PipelineModule(_layers())
    with pytest.raises(DSCompileConfigError, match="only 6 layers"):
        PipelineModule(_layers(), num_stages=7)
    x = torch.randn(2, 4)
    plain = nn.Sequential(*[m if isinstance(m, nn.Module) else _Lambda(m) for m in pm.forward_funcs])
    torch.testing.assert_close(pm(x), plain(x))  # the split markers are no-ops outside the engine


class _Lambda(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def test_tied_layers_share_one_module():
    from dscompile.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    layers = [
        TiedLayerSpec("embed", nn.Embedding, 10, 4),
        LayerSpec(nn.Linear, 4, 4),
        TiedLayerSpec("embed", nn.Embedding, 10, 4, forward_fn=lambda module, h: h @ module.weight.t()),
    ]
    pm = PipelineModule(layers, num_stages=1)
    assert [n for n, _ in pm.named_parameters()] == ["tied_modules.embed.weight", "1.weight", "1.bias"]
    assert pm.tied_weight_attrs == {"embed": ["weight"]}
    assert pm(torch.tensor([[1, 2]])).shape == (1, 2, 10)


def test_initialize_returns_the_pipeline_engine_for_a_pipeline_module():
    """One stage in one process: train_batch with loss_fn equals eager; eval_batch runs forward only."""
    from dscompile.pipe import PipelineModule

    torch.manual_seed(0)
    pm = PipelineModule(_layers(), num_stages=1, loss_fn=nn.functional.cross_entropy, activation_checkpoint_interval=2)
    ref = PipelineModule(_layers(), num_stages=1)
    ref.load_state_dict(pm.state_dict())
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, optimizer, _, _ = dscompile.initialize(model=pm, model_parameters=pm.parameters(), config=cfg)
    assert isinstance(engine, PipelineEngine) and engine.pcfg.stages == 1 and engine.pcfg.activation_checkpoint_interval == 2
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    data = [(torch.randn(2, 4), torch.randint(0, 3, (2,))) for _ in range(4)]
    loader = deepspeed.utils.RepeatingLoader(data)
    for step in range(2):
        loss = engine.train_batch(loader)
        expected = sum(nn.functional.cross_entropy(ref(x), y) for x, y in data[2 * step : 2 * step + 2]) / 2
        expected.backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    evaluated = engine.eval_batch(iter(data[:2]))
    with torch.no_grad():
        expected = sum(nn.functional.cross_entropy(ref(x), y) for x, y in data[:2]) / 2
    torch.testing.assert_close(evaluated, expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(DSCompileConfigError, match="contradicts PipelineModule"):
        dscompile.initialize(model=PipelineModule(_layers(), num_stages=1), config={**cfg, "pipeline": {"stages": 2}})
    with pytest.raises(DSCompileConfigError, match="its own partition_method"):
        dscompile.initialize(model=PipelineModule(_layers(), num_stages=1), config={**cfg, "pipeline": {"partition_method": "cost"}})


# -- pipeline stages that modify their inputs in place ------------------------------------------
class _InplaceStage(nn.Module):
    """A stage whose first layer is nn.ReLU(inplace=True)."""

    def __init__(self) -> None:
        super().__init__()
        self.relu = nn.ReLU(inplace=True)
        self.w = nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.relu(x) * self.w,)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("checkpoint", [False, True])
def test_stage_runner_lets_a_stage_modify_received_activations(checkpoint, compiled):
    """A received activation is a leaf that requires grad: the stage gets a copy it may modify,
    the gradient reaches the leaf, and a recomputed stage starts from the unmodified value
    (eager, and compiled by the dscompile backend with its default lowering)."""
    stage = _InplaceStage()
    fn = torch.compile(stage, backend="dscompile", dynamic=False) if compiled else stage
    received = torch.tensor([-1.0, 2.0, -3.0]).requires_grad_(True)  # as run_actions hands it over
    runner = GraphStageRunner(fn, checkpoint=checkpoint)
    (out,) = runner.forward(0, [received])
    torch.testing.assert_close(out, torch.tensor([0.0, 4.0, 0.0]))
    assert torch.equal(received.detach(), torch.tensor([-1.0, 2.0, -3.0]))  # the sender's value is intact
    (grad,) = runner.backward(0, [torch.ones(3)])
    torch.testing.assert_close(grad, torch.tensor([0.0, 2.0, 0.0]))
    torch.testing.assert_close(stage.w.grad, torch.tensor([0.0, 2.0, 0.0]))
