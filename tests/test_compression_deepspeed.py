"""DeepSpeed compression scripts run with only their imports changed, and compute what DeepSpeed 0.19.5 does.

DeepSpeed's ``init_compression`` swaps the model's layers, so the compression examples call the model
itself (``model(x)``, CIFAR), evaluate it directly and clean it with ``redundancy_clean``. Here the
model's own calls go through dscompile's compression passes. ``tests/deepspeed_scripts/compress_direct.py``
is a script of ours in that idiom; it runs with its imports swapped and is compared with a plain
PyTorch transcription of what DeepSpeed 0.19.5 computes (always) and with DeepSpeed 0.19.5 itself
(the last release with ``deepspeed.compression``) where ``DSCOMPILE_DEEPSPEED_0195`` names a
directory holding it (``pip install --target DIR deepspeed==0.19.5``).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dscompile.compression import get_compression_scheduler, init_compression, redundancy_clean
from dscompile.errors import DSCompileError
from dscompile.kernels.quantize import dequantize

SCRIPTS = Path(__file__).parent / "deepspeed_scripts"
sys.path.insert(0, str(SCRIPTS))
import ds_models  # noqa: E402

DEEPSPEED_0195 = os.environ.get("DSCOMPILE_DEEPSPEED_0195")
HAVE_0195 = bool(DEEPSPEED_0195) and (Path(DEEPSPEED_0195) / "deepspeed" / "compression" / "compress.py").is_file()
needs_deepspeed_0195 = pytest.mark.skipif(
    not HAVE_0195,
    reason="DeepSpeed 0.19.5 (the last release with deepspeed.compression) is not available: set DSCOMPILE_DEEPSPEED_0195 "
    "to a directory holding it (pip install --target DIR deepspeed==0.19.5)",
)
STEPS = 4
TIMEOUT_S = 900

# The CIFAR example's channel pruning (learned topk scores, conv1 -> conv2 and bn1 shrink with it, a
# related pattern matching nothing as its bn1 does for a ResNet built without batch norm) and the
# GPT-2 example's W8A8 (quantize_weight_in_forward, quantization_period 0, token-wise activations).
CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0, "torch_adam": True}},
    "compression_training": {
        "weight_quantization": {
            "shared_parameters": {"enabled": True, "schedule_offset": 0, "quantize_groups": 2, "quantize_weight_in_forward": True},
            "different_groups": {"wq1": {"params": {"start_bits": 8, "target_bits": 8, "quantization_period": 0}, "modules": ["fc"]}},
        },
        "activation_quantization": {
            "shared_parameters": {"enabled": True, "quantization_type": "symmetric", "range_calibration": "dynamic", "schedule_offset": 0},
            "different_groups": {"aq1": {"params": {"bits": 8}, "modules": ["fc"]}},
        },
        "channel_pruning": {
            "shared_parameters": {"enabled": True, "schedule_offset": 0, "method": "topk"},
            "different_groups": {
                "cp1": {
                    "params": {"dense_ratio": 0.5},
                    "modules": ["layer....conv1"],
                    "related_modules": [["layer....conv2", "layer....bn1", "layer....norm"]],
                }
            },
        },
    },
}


# -- DeepSpeed 0.19.5's compression, transcribed in plain PyTorch -----------------------------------
def ste(value: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``value`` forward, identity gradient to ``x`` (DeepSpeed's quantizers and TopKBinarizer)."""
    return x + (value - x).detach()


def sym_quantize(x: torch.Tensor, bits: int, groups: int) -> torch.Tensor:
    """DeepSpeed's SymQuantizer (compression/utils.py)."""
    levels = 2**bits
    flat = x.reshape(groups, -1)
    scale = 2 * flat.abs().amax(dim=-1, keepdim=True) / levels
    return ((flat / scale).round().clamp(-levels // 2, levels // 2 - 1) * scale).reshape(x.shape)


def topk_binarize(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """DeepSpeed's TopKBinarizer: 1 for the ceil(ratio * n) largest scores."""
    mask = torch.zeros(scores.numel())
    mask[scores.detach().flatten().sort(descending=True).indices[: math.ceil(ratio * scores.numel())]] = 1.0
    return ste(mask.reshape(scores.shape), scores)


def deepspeed_init_compression(model: ds_models.ResidualNet) -> list[nn.Parameter]:
    """The random numbers DeepSpeed's ``init_compression`` draws: a fresh layer built for every
    compressible module (then discarded for the model's weights), then conv1's channel scores."""
    for module in list(model.modules()):
        if isinstance(module, nn.Conv2d):
            nn.Conv2d(module.in_channels, module.out_channels, module.kernel_size, bias=module.bias is not None)
        elif isinstance(module, nn.Linear):
            nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
    scores = []
    for block in model.layer1:
        s = torch.empty(block.conv1.out_channels, 1, 1, 1)
        nn.init.kaiming_uniform_(s, a=math.sqrt(5))
        scores.append(nn.Parameter(s))
    return scores


def compressed_forward(model: ds_models.ResidualNet, scores: list[nn.Parameter], x: torch.Tensor) -> torch.Tensor:
    x = torch.relu(model.bn(model.conv(x)))
    for block, s in zip(model.layer1, scores):
        weight = block.conv1.weight * topk_binarize(s, 0.5).reshape(-1, 1, 1, 1)
        out = torch.relu(block.bn1(F.conv2d(x, weight, None, 1, 1)))
        x = torch.relu(x + block.bn2(block.conv2(out)))
    return cleaned_head(model, x.mean(dim=(2, 3)), ste(sym_quantize(model.fc.weight, 8, 2), model.fc.weight))


def cleaned_head(model: ds_models.ResidualNet, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(ste(sym_quantize(h, 8, h.shape[0]), h), weight, model.fc.bias)


def deepspeed_clean(model: ds_models.ResidualNet, scores: list[nn.Parameter]) -> dict[str, torch.Tensor]:
    """DeepSpeed's ``redundancy_clean``: pruned channels removed from conv1, bn1 and conv2's inputs; fc's
    weight baked at 8 bits (its input stays quantized)."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for block, s in zip(model.layer1, scores):
            keep = topk_binarize(s, 0.5).detach().reshape(-1).bool()
            block.conv1.weight = nn.Parameter(block.conv1.weight[keep])
            block.conv2.weight = nn.Parameter(block.conv2.weight[:, keep])
            bn = block.bn1
            bn.weight, bn.bias = nn.Parameter(bn.weight[keep]), nn.Parameter(bn.bias[keep])
            bn.running_mean, bn.running_var = bn.running_mean[keep], bn.running_var[keep]
        model.fc.weight.copy_(sym_quantize(model.fc.weight, 8, 2))
    return model.state_dict()


def reference_run() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """compress_direct.py as DeepSpeed 0.19.5 runs it, in plain PyTorch: what it reports and saves."""
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(ds_models.image_dataset(64, seed=0), batch_size=8, shuffle=True)
    model = ds_models.ResidualNet()
    scores = deepspeed_init_compression(model)
    rng = hashlib.sha1(torch.random.get_rng_state().numpy().tobytes()).hexdigest()
    optimizer = torch.optim.AdamW([*model.parameters(), *scores], lr=0.01, weight_decay=0.0)
    losses = []
    for step, (x, y) in enumerate(loader):
        if step == STEPS:
            break
        model.train()
        loss = F.cross_entropy(compressed_forward(model, scores, x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    images = ds_models.image_dataset(16, seed=1).tensors[0]
    model.eval()
    with torch.no_grad():
        before = compressed_forward(model, scores, images)
        state = deepspeed_clean(model, scores)
        cleaned = ds_models.ResidualNet()
        for block, s in zip(cleaned.layer1, scores):
            kept = int(topk_binarize(s, 0.5).sum())
            block.conv1 = nn.Conv2d(8, kept, 3, padding=1, bias=False)
            block.bn1 = nn.BatchNorm2d(kept)
            block.conv2 = nn.Conv2d(kept, 8, 3, padding=1, bias=False)
        cleaned.load_state_dict(state)
        cleaned.eval()
        x = torch.relu(cleaned.bn(cleaned.conv(images)))
        for block in cleaned.layer1:
            x = block(x)
        after = cleaned_head(cleaned, x.mean(dim=(2, 3)), cleaned.fc.weight)
    return {"losses": losses, "rng": rng, "eval": before.tolist(), "eval_clean": after.tolist()}, state


# -- the model's own calls --------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


# row pruning (l1: its mask is decided from the weights init_compression sees) and 4-bit weights in
# the forward with DeepSpeed's quantization_period 0
MLP_CONFIG = {
    "compression_training": {
        "row_pruning": {
            "shared_parameters": {"enabled": True, "schedule_offset": 0, "method": "l1"},
            "different_groups": {"rp": {"params": {"dense_ratio": 0.5}, "modules": ["fc1"]}},
        },
        "weight_quantization": {
            "shared_parameters": {"enabled": True, "schedule_offset": 0, "quantize_weight_in_forward": True},
            "different_groups": {"wq": {"params": {"start_bits": 4, "target_bits": 4, "quantization_period": 0}, "modules": ["fc2"]}},
        },
    }
}


def mlp_reference(model: MLP, x: torch.Tensor) -> torch.Tensor:
    """What DeepSpeed's LinearLayer_Compress computes: fc1's rows with the largest l1 norms, fc2 at 4 bits."""
    keep = torch.zeros(32)
    keep[torch.linalg.norm(model.fc1.weight.detach(), ord=1, dim=1).sort(descending=True).indices[:16]] = 1.0
    h = torch.relu(F.linear(x, model.fc1.weight * keep[:, None], model.fc1.bias * keep))
    return F.linear(h, ste(sym_quantize(model.fc2.weight, 4, 1), model.fc2.weight), model.fc2.bias)


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_prepared_model_called_directly_is_compressed() -> None:
    """``model(x)`` after init_compression computes the compressed function, forward and backward
    (DeepSpeed's swapped layers do), under the default lowering."""
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 16)
    init_compression(model, MLP_CONFIG)
    out = model(x)
    expected = mlp_reference(reference, x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, reference(x), atol=1e-3)  # the dense model computes something else
    out.square().sum().backward()
    expected.square().sum().backward()
    got = grads_of(model)
    for name, grad in grads_of(reference).items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected.detach(), rtol=1e-5, atol=1e-5)


def test_an_outer_compile_of_a_prepared_model_applies_its_own_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside someone else's trace (the engine's torch.compile, the user's) the model's call is traced
    there, with that compile's config, not its own routed compile's."""
    from dscompile import frontend

    seen: list[Any] = []
    original = frontend.GraphCompiler.__init__

    def recording(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        seen.append(config.steps_per_print)
        original(self, config, *args, **kwargs)

    monkeypatch.setattr(frontend.GraphCompiler, "__init__", recording)
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(4, 16)
    init_compression(model, MLP_CONFIG)
    direct = model(x).detach()
    assert seen == [10]  # the routed compile: the config's compression section (default steps_per_print)
    outer = torch.compile(model, backend="dscompile", options={**MLP_CONFIG, "steps_per_print": 7})
    torch.testing.assert_close(outer(x), direct, rtol=1e-6, atol=1e-6)
    assert seen == [10, 7]
    torch.testing.assert_close(model(x), direct, rtol=0, atol=0)  # and the model's own call still runs its graph
    assert seen == [10, 7]


def test_compressed_layers_refuse_calls_that_would_be_dense() -> None:
    """A copy of a prepared model (deepcopy drops the routing, as it drops Module.compile) would compute
    dense weights: it raises instead; a layer called alone is routed like the model. After
    redundancy_clean the model computes its compression in plain modules, eagerly."""
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 16)
    init_compression(model, MLP_CONFIG)
    compressed = model(x).detach()
    with pytest.raises(DSCompileError, match="'fc1' was called outside dscompile's compiled graphs"):
        copy.deepcopy(model)(x)
    h = torch.randn(4, 32)
    expected_fc2 = F.linear(h, sym_quantize(reference.fc2.weight, 4, 1), reference.fc2.bias)
    torch.testing.assert_close(model.fc2(h), expected_fc2, rtol=1e-5, atol=1e-5)  # a layer called alone is routed too
    layer = torch.compile(model.fc2, backend="dscompile", options=MLP_CONFIG)  # and so is one the user compiles
    torch.testing.assert_close(layer(h), expected_fc2, rtol=1e-5, atol=1e-5)
    redundancy_clean(model, MLP_CONFIG)
    assert model._compiled_call_impl is None
    with torch.no_grad():
        torch.testing.assert_close(model(x), compressed, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(copy.deepcopy(model)(x), compressed, rtol=1e-5, atol=1e-5)
        # compiled again with its config (an engine's forward after redundancy_clean), the cleaned model computes itself
        torch.testing.assert_close(torch.compile(model, backend="dscompile", options=MLP_CONFIG)(x), compressed, rtol=1e-5, atol=1e-5)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layer:
            x = block(x)
        return x


def block_reference(block: Block, keep: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """MLP_CONFIG on one block, as DeepSpeed's swapped layers compute it."""
    h = torch.relu(F.linear(x, block.fc1.weight * keep[:, None], block.fc1.bias * keep))
    return F.linear(h, ste(sym_quantize(block.fc2.weight, 4, 1), block.fc2.weight), block.fc2.bias)


def test_a_part_of_a_prepared_model_trains_compressed_when_called_alone() -> None:
    """DeepSpeed's layer-wise distillation example (compression/bert/run_glue_lkd.py) builds the engine,
    then trains each encoder layer of the prepared model called alone, with a plain AdamW, towards the
    teacher's layer output: that call is compressed, forward and backward (DeepSpeed's swapped layers
    are), under the default lowering; DeepSpeed 0.19.5 gives the same losses (checked by hand)."""
    import dscompile

    torch.manual_seed(0)
    model = Encoder()
    reference = copy.deepcopy(model)
    init_compression(model, MLP_CONFIG)
    engine, *_ = dscompile.initialize(model=model, config={**MLP_CONFIG, "train_micro_batch_size_per_gpu": 4})
    x, target = torch.randn(4, 16), torch.randn(4, 16)
    keeps = [torch.zeros(32).index_fill_(0, torch.linalg.norm(b.fc1.weight, ord=1, dim=1).sort(descending=True).indices[:16], 1.0) for b in reference.layer]
    with torch.no_grad():
        expected = block_reference(reference.layer[1], keeps[1], block_reference(reference.layer[0], keeps[0], x))
        torch.testing.assert_close(engine(x), expected, rtol=1e-5, atol=1e-5)
    for index in range(2):
        optimizer = torch.optim.AdamW(model.layer[index].parameters(), lr=1e-2)
        expected_optimizer = torch.optim.AdamW(reference.layer[index].parameters(), lr=1e-2)
        for _ in range(3):
            loss = F.mse_loss(model.layer[index](x), target)
            expected_loss = F.mse_loss(block_reference(reference.layer[index], keeps[index], x), target)
            dense_loss = F.mse_loss(reference.layer[index](x), target)
            assert abs(expected_loss.item() - dense_loss.item()) > 1e-3  # the dense block computes something else
            torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
            for opt, value in ((optimizer, loss), (expected_optimizer, expected_loss)):
                opt.zero_grad()
                value.backward()
                opt.step()
        for (name, got), want in zip(model.layer[index].named_parameters(), reference.layer[index].parameters()):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m, n=f"layer {index} {name}": f"{n}: {m}")


def test_the_teacher_stays_dense_under_its_own_engine() -> None:
    """DeepSpeed's BERT example wraps its teacher with ``deepspeed.initialize`` and the same config:
    DeepSpeed's engine only schedules layers ``init_compression`` swapped, so the teacher it was
    given stays the dense model (its logits are the distillation targets)."""
    import dscompile

    torch.manual_seed(0)
    student, teacher = MLP(), MLP()
    dense = copy.deepcopy(teacher)
    x = torch.randn(4, 16)
    config = {"train_micro_batch_size_per_gpu": 4, **MLP_CONFIG}
    init_compression(student, config, teacher_model=teacher)
    engine, *_ = dscompile.initialize(model=teacher, config=config)
    engine.eval()
    with torch.no_grad():
        torch.testing.assert_close(engine(x), dense(x), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(teacher(x), dense(x), rtol=0, atol=0)
    assert not any(hasattr(m, "ds_compression") for m in teacher.modules())


def test_init_compression_draws_the_random_numbers_deepspeeds_draws() -> None:
    """DeepSpeed builds a fresh layer for every compressible module (its initializers draw) before it
    draws the learned scores: the same scores come out, and the stream continues where DeepSpeed's
    does (a loader shuffled afterwards draws the same batches)."""
    torch.manual_seed(3)
    model = ds_models.ResidualNet()
    init_compression(model, {"compression_training": CONFIG["compression_training"]})
    got = torch.random.get_rng_state()
    torch.manual_seed(3)
    expected_scores = deepspeed_init_compression(ds_models.ResidualNet())
    assert torch.equal(got, torch.random.get_rng_state())
    for block, scores in zip(model.layer1, expected_scores):
        assert torch.equal(block.conv1.ds_compression.channel_scores.detach(), scores.detach())


def test_the_schedule_of_a_prepared_model_drives_its_direct_calls() -> None:
    """Row pruning from step 2: the model's own calls follow the schedule (its switches are graph inputs)."""
    config = copy.deepcopy(MLP_CONFIG)
    config["compression_training"]["row_pruning"]["shared_parameters"]["schedule_offset"] = 2
    del config["compression_training"]["weight_quantization"]
    torch.manual_seed(0)
    model = MLP()
    dense = copy.deepcopy(model)
    x = torch.randn(4, 16)
    init_compression(model, config)
    scheduler = get_compression_scheduler(model)
    with torch.no_grad():
        for step in range(4):
            scheduler.step(step)
            expected = dense(x) if step < 2 else F.linear(torch.relu(model.fc1.ds_compression.row_mask * dense.fc1(x)), dense.fc2.weight, dense.fc2.bias)
            torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5, msg=lambda m, s=step: f"step {s}: {m}")


def test_redundancy_clean_keeps_an_evaluated_model_in_eval_mode() -> None:
    """Cleaned layers replace the pruned ones in the mode of the model: a BatchNorm built fresh in training
    mode would normalize the evaluated model's batches with their own statistics."""
    model = ds_models.ResidualNet()
    init_compression(model, {"compression_training": CONFIG["compression_training"]})
    model.eval()
    redundancy_clean(model, {"compression_training": CONFIG["compression_training"]})
    assert isinstance(model.layer1[0].bn1, nn.BatchNorm2d) and model.layer1[0].bn1.num_features == 4
    assert not any(m.training for m in model.modules())


# -- running the script -----------------------------------------------------------------------------
def swap_imports(source: str) -> str:
    """What a user changes (the rule of test_deepspeed_scripts.py): ``import deepspeed`` and ``from deepspeed.x import``."""
    source = re.sub(r"^import deepspeed$", "import dscompile as deepspeed", source, flags=re.MULTILINE)
    return re.sub(r"^from deepspeed(\.\S+)? import", lambda m: f"from dscompile{m.group(1) or ''} import", source, flags=re.MULTILINE)


def run_script(workdir: Path, framework: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """compress_direct.py on one torchrun rank under ``framework`` ('dscompile': imports swapped;
    'deepspeed': DeepSpeed 0.19.5, unmodified); returns its report and the state_dict it saved."""
    folder = workdir / framework
    shutil.copytree(SCRIPTS, folder, ignore=shutil.ignore_patterns("__pycache__"))
    if framework == "dscompile":
        for path in folder.glob("*.py"):
            path.write_text(swap_imports(path.read_text()))
    config, out, saved = folder / "ds_config.json", folder / "result.json", folder / "clean.pt"
    config.write_text(json.dumps(CONFIG))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(folder), "PYTHONFAULTHANDLER": "1"}
    if framework == "deepspeed":
        env["PYTHONPATH"] = os.pathsep.join([str(DEEPSPEED_0195), str(folder)])
        # DeepSpeed builds its CPU ops at start; 0.19.5's builds in its own folder, apart from another version's
        default = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
        env["TORCH_EXTENSIONS_DIR"] = str(default / "deepspeed-0.19.5")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", str(folder / "compress_direct.py"),
           "--deepspeed", "--deepspeed_config", str(config), "--steps", str(STEPS), "--out", str(out), "--save", str(saved)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=folder)
    if proc.returncode != 0 or not out.is_file():
        raise AssertionError(f"{framework} run of compress_direct.py failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text()), torch.load(saved, weights_only=False)


@pytest.fixture(scope="module")
def dscompile_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    return run_script(tmp_path_factory.mktemp("compress_direct"), "dscompile")


def as_deepspeed_export(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """dscompile's cleaned state_dict with the packed fc weight unpacked to its float values (DeepSpeed keeps them as floats)."""
    from dscompile.kernels.quantize import PackedWeight

    fc = {k.removeprefix("fc."): v for k, v in state.items() if k.startswith("fc.")}
    extra = fc["_extra_state"]
    packed = PackedWeight(fc["qweight"], fc["scales"], fc.get("zeros"), extra["bits"], extra["group_size"], tuple(extra["shape"]))
    floats = {k: v for k, v in state.items() if not k.startswith("fc.")}
    return {**floats, "fc.weight": dequantize(packed), "fc.bias": fc["bias"]}


def assert_same_export(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float) -> None:
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert got[key].shape == value.shape, (key, got[key].shape, value.shape)
        torch.testing.assert_close(got[key].double(), value.double(), rtol=0, atol=atol, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.slow
@pytest.mark.distributed
def test_direct_calls_script_matches_plain_pytorch(dscompile_run: tuple[dict[str, Any], dict[str, torch.Tensor]]) -> None:
    """Per-step losses, the direct evaluation before and after redundancy_clean, the random stream
    init_compression leaves and the cleaned export all equal DeepSpeed 0.19.5's, transcribed in PyTorch."""
    got, state = dscompile_run
    expected, expected_state = reference_run()
    assert got["rng"] == expected["rng"]
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected["losses"]), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.tensor(got["eval"]), torch.tensor(expected["eval"]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.tensor(got["eval_clean"]), torch.tensor(expected["eval_clean"]), rtol=1e-4, atol=1e-4)
    assert_same_export(as_deepspeed_export(state), expected_state, atol=1e-4)
    assert state["fc.qweight"].dtype == torch.int8  # really smaller: fc's weight is stored as 8-bit codes


@pytest.mark.slow
@pytest.mark.distributed
@needs_deepspeed_0195
def test_direct_calls_script_matches_deepspeed_0195(
    dscompile_run: tuple[dict[str, Any], dict[str, torch.Tensor]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The same script, unmodified, under DeepSpeed 0.19.5: the same random stream, losses within 2e-3 per
    step (fp32), the same cleaned export (shapes exact; DeepSpeed stores fc's 8-bit values as floats).

    DeepSpeed's engine drifts from its own layers from the third step on (about 1e-3 in the losses,
    a few 1e-3 in the weights): the same layers trained by a plain loop (init_compression, then
    torch.optim.AdamW) match the PyTorch transcription above, and dscompile, to 1e-7. The evaluations
    and the export are compared at the size of that drift."""
    got, state = dscompile_run
    expected, expected_state = run_script(tmp_path_factory.mktemp("compress_direct_ds"), "deepspeed")
    assert got["rng"] == expected["rng"]
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(expected["losses"]), rtol=0, atol=2e-3)
    torch.testing.assert_close(torch.tensor(got["eval"]), torch.tensor(expected["eval"]), rtol=0, atol=2e-2)
    torch.testing.assert_close(torch.tensor(got["eval_clean"]), torch.tensor(expected["eval_clean"]), rtol=0, atol=2e-2)
    expected_state = {k: v for k, v in expected_state.items() if "mask" not in k and "scores" not in k}
    assert_same_export(as_deepspeed_export(state), expected_state, atol=2e-2)
