"""Extensions share state through ``engine.context`` (``runtime/engine_context.py``), never attributes they attach
to the engine: a static check over every extension module, and the context of a real ZeRO-2 engine."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

import dscompile
from dscompile.runtime.engine_context import ENGINE_VIEWS, EngineContext
from dscompile.runtime.zero_shard import ZeroModule, ZeroPartition

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("dscompile", "passes", "backends")
# modules that publish shared state on the engine's behalf without defining an extension (a script's mpu)
ALSO_CHECKED = ("dscompile/runtime/model_parallel_unit.py",)


def _defines_extension(tree: ast.Module) -> bool:
    """A module with an ``EngineExtension`` subclass or a ``configure(self, engine, ...)`` method."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            if any((b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else "") == "EngineExtension" for b in node.bases):
                return True
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "configure":
            names = [a.arg for a in node.args.args]
            if names[:2] == ["self", "engine"]:
                return True
    return False


def _extension_modules() -> list[Path]:
    out = []
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.name == "engine_extension.py":
                continue  # the protocol itself: its configure is the no-op default
            if _defines_extension(ast.parse(path.read_text(), filename=str(path))):
                out.append(path)
    return out + [ROOT / name for name in ALSO_CHECKED]


def _is_engine(node: ast.expr) -> bool:
    """``engine`` or ``self.engine`` (an extension that kept the engine it configured)."""
    if isinstance(node, ast.Name):
        return node.id == "engine"
    return isinstance(node, ast.Attribute) and node.attr == "engine" and isinstance(node.value, ast.Name) and node.value.id == "self"


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, (ast.For, ast.AsyncFor)):
        targets = [node.target]
    elif isinstance(node, (ast.With, ast.AsyncWith)):
        targets = [item.optional_vars for item in node.items if item.optional_vars is not None]
    elif isinstance(node, ast.NamedExpr):
        targets = [node.target]
    else:
        return []
    flat: list[ast.expr] = []
    while targets:
        t = targets.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            targets.extend(t.elts)
        elif isinstance(t, ast.Starred):
            targets.append(t.value)
        else:
            flat.append(t)
    return flat


def engine_attribute_writes(path: Path, root: Path = ROOT) -> list[str]:
    """``file:line`` of every write to an attribute of the engine: ``engine.x = ...`` (any assignment form),
    ``del engine.x``, ``setattr(engine, ...)`` and ``delattr(engine, ...)``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    where = path.relative_to(root)
    found = []
    for node in ast.walk(tree):  # function bodies included
        targets = _targets(node) + (list(node.targets) if isinstance(node, ast.Delete) else [])
        for t in targets:
            if isinstance(t, ast.Attribute) and _is_engine(t.value):
                found.append(f"{where}:{t.lineno}: engine.{t.attr} written")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            if node.args and _is_engine(node.args[0]):
                found.append(f"{where}:{node.lineno}: {node.func.id}(engine, ...)")
    return sorted(found, key=lambda hit: int(hit.split(":")[1]))


def test_the_scan_finds_the_extension_modules() -> None:
    """The check below only means something if it reads the modules that hold the extensions."""
    names = {str(p.relative_to(ROOT)) for p in _extension_modules()}
    for expected in (
        "dscompile/runtime/zero_extension.py",
        "dscompile/runtime/zero_profile.py",
        "dscompile/runtime/loss_scaler.py",
        "dscompile/runtime/onebit/engine.py",
        "dscompile/runtime/compression/extension.py",
        "passes/offload.py",
        "passes/sequence_parallel.py",
        "passes/tensor_parallel/extension.py",
        "dscompile/runtime/model_parallel_unit.py",
    ):
        assert expected in names, f"{expected} not scanned; scanned: {sorted(names)}"


def test_the_scan_sees_every_assignment_form(tmp_path: Path) -> None:
    """Every way of writing an engine attribute is caught; reads and writes to engine.context's fields are not."""
    bad = tmp_path / "ext.py"
    bad.write_text(
        "class X(EngineExtension):\n"
        "    def configure(self, engine):\n"
        "        engine.a = 1\n"
        "        engine.b += 1\n"
        "        engine.c: int = 1\n"
        "        x, engine.d = 1, 2\n"
        "        setattr(engine, 'e', 1)\n"
        "        self.engine.f = 1\n"
        "        del engine.g\n"
        "        engine.context.zero = 1\n"
        "        y = engine.module\n"
    )
    found = engine_attribute_writes(bad, tmp_path)
    assert [int(hit.split(":")[1]) for hit in found] == [3, 4, 5, 6, 7, 8, 9], found  # not line 10 (the context) nor 11 (a read)


def test_extensions_never_write_engine_attributes() -> None:
    """What an extension shares goes into engine.context (runtime/engine_context.py); the core's own optimizer,
    gradients and plan change through replace_optimizer, install_gradients and replan."""
    found = [hit for path in _extension_modules() for hit in engine_attribute_writes(path)]
    assert not found, "extensions write attributes of the engine (use engine.context or the core's methods):\n" + "\n".join(found)


def test_no_module_writes_engine_attributes() -> None:
    """Beyond extensions: no module (checkpoint loading, ``initialize``, the Hugging Face integration, ...) sets an
    attribute of an engine from outside it; the counters, the scheduler and the rest change through the core's methods
    (``restore_counters``, ``install_lr_scheduler``, ``replace_optimizer``, ...) or ``engine.context``."""
    found = [hit for top in SOURCES for path in sorted((ROOT / top).rglob("*.py")) for hit in engine_attribute_writes(path)]
    assert not found, "modules write attributes of the engine (use the core's methods or engine.context):\n" + "\n".join(found)


# ---------------------------------------------------------------------------------------------
# a real engine
# ---------------------------------------------------------------------------------------------
class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.fc2(torch.relu(self.fc1(x))), y)


def _engine(stage: int) -> tuple[dscompile.DSCompileEngine, _Net]:
    model = _Net()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage},
    }
    engine, _, _, _ = dscompile.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, model


def test_zero2_engine_context_holds_the_shared_state() -> None:
    engine, model = _engine(2)
    context = engine.context
    assert isinstance(context, EngineContext)
    assert isinstance(context.zero, ZeroPartition) and context.zero.stage == 2
    assert isinstance(context.compile_target, ZeroModule) and context.compile_target.module is model
    assert context.compiles_model and context.process_groups is None and context.zero_profiler is None
    # the engine's views show the context, and are not attributes of the engine's own
    assert engine.zero is context.zero and engine.compile_target is context.compile_target and engine.zero_module is context.compile_target
    for name in ENGINE_VIEWS:
        assert name not in engine.__dict__ and name not in engine._modules, name
    # the optimizer ZeRO put in place steps the shards, and the scheduler-free engine trains through the context's module
    assert {id(p) for g in engine.optimizer.param_groups for p in g["params"]} == {id(s) for s in context.zero.shards}
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 8, generator=gen), torch.randint(0, 4, (4,), generator=gen)
    before = [s.detach().clone() for s in context.zero.shards]
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    assert any(not torch.equal(b, s) for b, s in zip(before, context.zero.shards))


@pytest.mark.parametrize("name", ["zero", "compile_target", "process_groups", "zero_profiler", "compiles_model", "compute_dtype"])
def test_engine_views_of_the_context_are_read_only(name: str) -> None:
    engine, _ = _engine(2)
    value = {"compile_target": nn.Linear(2, 2), "compiles_model": False}.get(name, object())  # a module too: nn.Module would register it
    with pytest.raises(AttributeError, match=f"{name} is read-only"):
        setattr(engine, name, value)
    assert getattr(engine, name) is getattr(engine.context, name)


def test_plain_engine_context() -> None:
    """Without ZeRO: the model is what compiles, and there is no partition."""
    model = _Net()
    engine, _, _, _ = dscompile.initialize(model=model, model_parameters=model.parameters(), config={"train_micro_batch_size_per_gpu": 4})
    assert engine.context.compile_target is model and engine.context.zero is None and engine.zero is None
