"""Device-correct runtime code, checked on a CPU-only machine.

No GPU is at hand in most runs, so the rules of ``dscompile/runtime/devices.py`` are enforced by
a lint over the modules that run outside graphs (the engines and ``dscompile/runtime``), by the
helpers' own unit tests with an NCCL-like backend simulated, and by GPU-marked tests that run
where CUDA exists:

- every tensor factory (``torch.zeros``, ``torch.tensor``, ``torch.arange``...) names its device;
  the allow-list says why each exception is right;
- random-state handling goes through ``devices.py`` (``fork_rng`` / ``set_rng_state`` elsewhere
  would fork or restore only the CPU generator), except where a checkpoint stores the CPU state
  beside ``capture_rng``'s device states.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dscompile.runtime import devices

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_FILES = sorted([*(ROOT / "dscompile" / "engines").glob("*.py"), *(ROOT / "dscompile" / "runtime").glob("*.py")])

FACTORIES = {"zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint", "linspace", "eye", "as_tensor", "empty_strided", "scalar_tensor"}

# (file, enclosing function) -> why a factory there may omit ``device=``.
FACTORY_ALLOWED: dict[tuple[str, str], str] = {}

# (file, enclosing function) -> why the CPU generator is handled directly there.
RNG_ALLOWED: dict[tuple[str, str], str] = {
    ("dscompile/runtime/devices.py", "capture_rng"): "the helper itself",
    ("dscompile/runtime/devices.py", "restore_rng"): "the helper itself",
    ("dscompile/runtime/devices.py", "forked_rng"): "the helper itself",
    ("dscompile/runtime/data_parallel.py", "save_checkpoint"): "stores the CPU state next to capture_rng(...) of the parameters' devices",
    ("dscompile/runtime/data_parallel.py", "load_checkpoint"): "restores the CPU state next to restore_rng(...) of the saved devices",
    ("dscompile/runtime/zero_checkpoint.py", "save"): "stores the CPU state next to capture_rng(...) of the shards' devices",
    ("dscompile/runtime/zero_checkpoint.py", "_restore_rng"): "restores the CPU state next to restore_rng(...) of the saved devices",
    ("dscompile/runtime/tensor_parallel_gradients.py", "save_checkpoint"): "stores the CPU state next to capture_rng(...) of the parameters' devices",
    ("dscompile/runtime/tensor_parallel_gradients.py", "load_checkpoint"): "restores the CPU state next to restore_rng(...) of the saved devices",
}
RNG_CALLS = {"fork_rng", "set_rng_state", "get_rng_state"}


def _torch_call_name(node: ast.Call) -> str | None:
    """``zeros`` for ``torch.zeros(...)``, ``fork_rng`` for ``torch.random.fork_rng(...)``; None otherwise."""
    func = node.func
    if isinstance(func, ast.Attribute):
        base = func.value
        while isinstance(base, ast.Attribute):
            base = base.value
        if isinstance(base, ast.Name) and base.id == "torch":
            return func.attr
    return None


def _violations(path: Path) -> tuple[list[str], list[str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    factories, rng = [], []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = function
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = child.name
            if isinstance(child, ast.Call):
                called = _torch_call_name(child)
                where = f"{rel}:{child.lineno} in {function or '<module>'}"
                if called in FACTORIES and not any(k.arg == "device" for k in child.keywords) and (rel, function) not in FACTORY_ALLOWED:
                    factories.append(f"{where}: torch.{called}(...) without device=")
                if called in RNG_CALLS and (rel, function) not in RNG_ALLOWED:
                    rng.append(f"{where}: torch...{called}(...) handles the CPU generator only; use dscompile.runtime.devices")
            visit(child, name)

    visit(tree, "")
    return factories, rng


def test_lint_finds_what_it_looks_for(tmp_path: Path) -> None:
    """The lint can fail: a CPU-only factory and a CPU-only RNG fork are both reported."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import torch\n\ndef f():\n    a = torch.zeros(3)\n"
        "    with torch.random.fork_rng(devices=[]):\n        pass\n    return torch.ones(2, device='cuda')\n"
    )
    factories, rng = _violations(sample)
    assert len(factories) == 1 and "torch.zeros" in factories[0]
    assert len(rng) == 1 and "fork_rng" in rng[0]


def test_runtime_code_names_devices() -> None:
    factories, rng = [], []
    for path in RUNTIME_FILES:
        f, r = _violations(path)
        factories += f
        rng += r
    assert not factories, "tensors built without a device (collectives and parameters may be on a GPU):\n" + "\n".join(factories)
    assert not rng, "\n".join(rng)
    # every allow-list entry still points at code that exists (a stale entry would hide a regression elsewhere)
    for rel, function in [*FACTORY_ALLOWED, *RNG_ALLOWED]:
        assert f"def {function}(" in (ROOT / rel).read_text(), (rel, function)


# ---------------------------------------------------------------------------------------------
# the helpers
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def one_rank_gloo() -> object:
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_collective_device_without_process_group() -> None:
    assert not dist.is_initialized()
    assert devices.collective_device() == torch.device("cpu")
    assert devices.collective_device(like=torch.device("meta")) == torch.device("meta")


def test_collective_device_follows_the_backend(one_rank_gloo: object, monkeypatch: pytest.MonkeyPatch) -> None:
    assert devices.collective_device() == torch.device("cpu")
    assert devices.collective_device(like=torch.zeros(1, device="cpu")) == torch.device("cpu")
    # NCCL serves CUDA only: flags and CPU-made buffers must move to the current GPU
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cuda:nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert devices.backend_device_types() == ["cuda"]
    assert devices.collective_device() == torch.device("cuda", 3)
    assert devices.collective_device(like=torch.zeros(1)) == torch.device("cuda", 3)
    assert devices.collective_device(like=torch.device("cuda", 1)) == torch.device("cuda", 1)


def test_engine_agreement_and_zero_norm_put_buffers_where_the_backend_wants(one_rank_gloo: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's cross-rank flag and ZeRO's norm buffer ask ``collective_device``: with NCCL they would be on the GPU."""
    from dscompile.runtime import training_core, zero_shard

    asked: list[object] = []

    def spy(group: object = None, like: object = None) -> torch.device:
        asked.append(like)
        return torch.device("cpu")

    monkeypatch.setattr(training_core, "collective_device", spy)
    assert training_core._agree_any(True) is True and training_core._agree_any(False) is False
    monkeypatch.setattr(zero_shard, "collective_device", spy)
    model = torch.nn.Linear(4, 2)
    partition = zero_shard.ZeroPartition(model, stage=2)
    assert float(partition.grad_norm_squared()) == 0.0
    zero_shard.check_same_parameters(list(model.named_parameters()), None)
    assert len(asked) >= 4


def test_rng_helpers_replay_cpu_randomness() -> None:
    state = devices.capture_rng([])
    first = torch.rand(5)
    with devices.forked_rng([]):
        devices.restore_rng(state)
        again = torch.rand(5)
    after = torch.rand(5)
    assert torch.equal(first, again)
    assert not torch.equal(after, first)  # the caller's generator went on, unaffected by the fork
    restored = devices.RngState.from_dict(state.to_dict())
    devices.restore_rng(restored)
    assert torch.equal(torch.rand(5), first)


def test_stage_recompute_replays_dropout_masks() -> None:
    """GraphStageRunner(checkpoint=True) recomputes in backward on the forward's RNG state."""
    from dscompile.engines.pipeline_parallel import GraphStageRunner

    def stage(x: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.nn.functional.dropout(x * 2.0, p=0.5, training=True),)

    grads = []
    for checkpoint in (False, True):
        torch.manual_seed(0)
        x = torch.randn(64, requires_grad=True)
        runner = GraphStageRunner(stage, checkpoint=checkpoint)
        out = runner.forward(0, [x])
        torch.rand(3)  # other work between forward and backward moves the generator on
        grads.append(runner.backward(0, [torch.ones_like(out[0])])[0])
    assert torch.equal(grads[0], grads[1])
    assert (grads[0] == 0).any() and (grads[0] != 0).any()


@pytest.mark.gpu
def test_cuda_generators_are_captured_and_replayed() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(1024, device=device)
    state = devices.capture_rng(devices.accelerator_devices([x]))
    assert device in state.devices
    first = torch.rand(1024, device=device)
    with devices.forked_rng(list(state.devices)):
        devices.restore_rng(state)
        again = torch.rand(1024, device=device)
    assert torch.equal(first, again)
    assert not torch.equal(torch.rand(1024, device=device), first)


@pytest.mark.gpu
def test_stage_recompute_replays_cuda_dropout_masks() -> None:
    from dscompile.engines.pipeline_parallel import GraphStageRunner

    def stage(x: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.nn.functional.dropout(x * 2.0, p=0.5, training=True),)

    grads = []
    for checkpoint in (False, True):
        torch.manual_seed(0)
        x = torch.randn(4096, device="cuda", requires_grad=True)
        runner = GraphStageRunner(stage, checkpoint=checkpoint)
        out = runner.forward(0, [x])
        torch.rand(3, device="cuda")
        grads.append(runner.backward(0, [torch.ones_like(out[0])])[0])
    assert torch.equal(grads[0], grads[1])
