"""Hugging Face's Trainer with a dscompile ds_config: one import line changed (``dscompile.integrations.huggingface``).

``tests/hf_scripts/trainer_clm.py`` is a Trainer script in the usual idiom (``TrainingArguments(deepspeed=...)``,
``train``, ``evaluate``, ``save_model``, ``resume_from_checkpoint``) on a tiny GPT-2 built from a config and random
tokens. The tests run it on two gloo ranks under torchrun with its ``from transformers import Trainer,
TrainingArguments`` line swapped for dscompile's, under the default lowering, and compare it with the same script
run by the plain Trainer in one process over the same global batches (the per-device batch doubled): the loss and
gradient norm of every step, the evaluation losses and the saved model (``from_pretrained`` format). Where
DeepSpeed is installed, the unmodified script also drives DeepSpeed itself through the Trainer.

Why one process as the reference and not the plain Trainer on two ranks: with gradient accumulation on gloo, the
plain Trainer's DDP path (``no_sync`` on the first micro-batches, ``find_unused_parameters=True``, GPT-2's tied
embeddings) gives other gradients than one process (a gradient norm of 1.392 against 1.003 at the first step of
this script), while DeepSpeed's Trainer path, dscompile's, and DDP with ``sync_each_batch`` or without
``find_unused_parameters`` all agree with one process.

Saved weights are compared with ``atol = WEIGHT_ATOL``: AdamW moves a weight by about the learning rate whatever
the size of its gradient, so weights whose gradient is rounding noise (an attention key bias, whose exact gradient
is zero) follow the rounding, and Inductor rounds differently from eager PyTorch. A run whose optimizer did nothing
differs by about ``STEPS * lr``, forty times more.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SCRIPTS = Path(__file__).parent / "hf_scripts"
SCRIPT = "trainer_clm.py"
HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
WORLD = 2
MICRO = 2
STEPS = 4
LR = 1e-2
TIMEOUT_S = 900
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 1e-3
BF16_LOSS_ATOL = 5e-3
HF_IMPORT = "from transformers import Trainer, TrainingArguments"
DSCOMPILE_IMPORT = "from dscompile.integrations.huggingface import Trainer, TrainingArguments"

AUTO_BATCH = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}
ZERO2 = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}, **AUTO_BATCH}
ZERO2_OFFLOAD = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}, **AUTO_BATCH}
ZERO3 = {
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"},
    "bf16": {"enabled": "auto"},
    **AUTO_BATCH,
}
# The config's own optimizer and scheduler, every value "auto" (torch_adam: DeepSpeed builds no fused op on CPU)
ZERO2_OPTIMIZER_SCHEDULER = {
    **ZERO2,
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto", "torch_adam": True}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto"}},
}

# DeepSpeedExamples' AutoTP Trainer example: its config with autotp_size 2 (its run.sh sets 4 or 8 for 4 or 8 GPUs)
ZERO2_AUTOTP = {**ZERO2, "zero_optimization": {"stage": 2, "gather_16bit_weights_on_model_save": True}, "tensor_parallel": {"autotp_size": 2}}

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def swap_import(source: str) -> str:
    """The one line a user changes."""
    swapped, count = re.subn(f"^{re.escape(HF_IMPORT)}$", DSCOMPILE_IMPORT, source, flags=re.MULTILINE)
    assert count == 1
    return swapped


class Runs:
    """Runs of the script, one per (framework, config, flags) in a session, each in its own output folder."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.done: dict[str, dict[str, Any]] = {}
        source = (SCRIPTS / SCRIPT).read_text()
        for framework, text in (("hf", source), ("dscompile", swap_import(source))):
            (workdir / framework).mkdir()
            (workdir / framework / SCRIPT).write_text(text)

    def __call__(self, framework: str, config: dict | None, *flags: str, world: int = WORLD) -> dict[str, Any]:
        """``framework``: 'hf' runs the script as written (with a config: transformers drives DeepSpeed), 'dscompile'
        the swapped one. Returns what rank 0 wrote, with ``output_dir``. The per-rank batch keeps the global batch
        of ``MICRO`` * ``WORLD`` per micro-step: the ranks of a tensor-parallel group read the same batch."""
        key = json.dumps([framework, config, flags, world], sort_keys=True)
        if key not in self.done:
            self.done[key] = self._run(framework, config, flags, world, f"run{len(self.done)}")
        return self.done[key]

    def _run(self, framework: str, config: dict | None, flags: tuple[str, ...], world: int, tag: str) -> dict[str, Any]:
        folder = self.workdir / framework
        out, output_dir = folder / f"{tag}.json", folder / tag
        data_parallel = world // int(((config or {}).get("tensor_parallel") or {}).get("autotp_size", 1))
        batch = MICRO * WORLD // data_parallel
        cli = ["--out", str(out), "--output_dir", str(output_dir), "--batch", str(batch), "--max_steps", str(STEPS), "--lr", str(LR), *flags]
        if config is not None:
            (folder / f"{tag}.ds_config.json").write_text(json.dumps(config))
            cli += ["--deepspeed", str(folder / f"{tag}.ds_config.json")]
        launcher = [sys.executable] if world == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "DS_ACCELERATOR": "cpu",
            "PYTHONFAULTHANDLER": "1",
        }
        proc = subprocess.run([*launcher, str(folder / SCRIPT), *cli], capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=folder)
        if proc.returncode != 0 or not out.is_file():
            errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "Error" in line]
            raise AssertionError(f"{framework} run {cli} failed ({proc.returncode}):\n" + "\n".join(errors[-8:]) + "\n" + proc.stderr[-4000:])
        record = json.loads(out.read_text())
        record["output_dir"] = str(output_dir)
        return record


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("hf_trainer"))


def assert_series(got: list[float], expected: list[float], label: str, rtol: float = LOSS_RTOL, atol: float = 1e-6) -> None:
    torch.testing.assert_close(
        torch.tensor(got, dtype=torch.float64),
        torch.tensor(expected, dtype=torch.float64),
        rtol=rtol,
        atol=atol,
        msg=lambda detail: f"{label}: got {got}, expected {expected}\n{detail}",
    )


def saved_weights(record: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The saved model, loaded back with ``from_pretrained`` (what a user does with it)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(record["saved"], dtype=torch.float32)
    return {name: p.detach() for name, p in model.named_parameters()}


def assert_same_weights(got: dict[str, Any], expected: dict[str, Any], atol: float = WEIGHT_ATOL) -> None:
    weights, reference = saved_weights(got), saved_weights(expected)
    assert weights.keys() == reference.keys()
    for name, value in weights.items():
        torch.testing.assert_close(value, reference[name], rtol=0, atol=atol, msg=lambda detail, n=name: f"{n}: {detail}")


def assert_matches_one_process(got: dict[str, Any], reference: dict[str, Any]) -> None:
    assert got["world_size"] == WORLD and reference["world_size"] == 1
    assert got["steps"] == reference["steps"] == list(range(1, STEPS + 1))
    assert_series(got["losses"], reference["losses"], "losses per step")
    assert_series(got["grad_norms"], reference["grad_norms"], "gradient norms per step")
    assert_series([got["eval_after"]], [reference["eval_after"]], "evaluation loss after training")
    assert_same_weights(got, reference)


def test_zero2_offload_matches_the_plain_trainer(run: Runs) -> None:
    """ZeRO-2 with the optimizer offloaded to the CPU, two micro-batches per step; evaluated before training, every
    two steps (saving a checkpoint each time) and at the end, after ``load_best_model_at_end`` brought back the
    checkpoint of step 2 (the saved model is that one)."""
    reference = run("hf", None, "--eval_before", "--best", world=1)
    got = run("dscompile", ZERO2_OFFLOAD, "--eval_before", "--best")
    assert_matches_one_process(got, reference)
    assert_series([got["eval_before"]], [reference["eval_before"]], "evaluation loss before training")
    assert_series(got["evals"], reference["evals"], "evaluation losses")
    assert Path(got["best_checkpoint"]).name == Path(reference["best_checkpoint"]).name == "checkpoint-2"  # not the last one


def test_zero3_matches_the_plain_trainer_and_saves_full_weights(run: Runs) -> None:
    """ZeRO-3 (the "auto" bucket sizes filled from the model's hidden size): the saved model is the whole model,
    gathered from the shards, equal to the one-process one."""
    assert_matches_one_process(run("dscompile", ZERO3, "--save_steps", "2"), run("hf", None, world=1))


def test_zero3_resumes_from_a_trainer_checkpoint(run: Runs) -> None:
    """A run resumed from ``checkpoint-2`` (weights, optimizer, scheduler, counters, data position) continues as if
    never stopped."""
    whole = run("dscompile", ZERO3, "--save_steps", "2")
    checkpoint = Path(whole["output_dir"]) / "checkpoint-2"
    assert (checkpoint / "latest").is_file() and (checkpoint / "model.safetensors").is_file()
    resumed = run("dscompile", ZERO3, "--resume", str(checkpoint))
    assert resumed["global_step"] == STEPS
    assert_series(resumed["losses"][2:], whole["losses"][2:], "losses after resuming", rtol=1e-6, atol=1e-7)
    assert_series([resumed["eval_after"]], [whole["eval_after"]], "evaluation loss after resuming", rtol=1e-6, atol=1e-7)
    assert_same_weights(resumed, whole, atol=1e-6)


@pytest.mark.extended
def test_zero3_bf16_trains_like_the_plain_trainer_in_bf16(run: Runs) -> None:
    """``bf16.enabled: auto`` filled from ``--bf16``: the losses follow the plain Trainer's bf16 autocast run, and the
    weights moved as far and in the same direction (an optimizer that does nothing fails here)."""
    reference = run("hf", None, "--bf16", world=1)
    got = run("dscompile", ZERO3, "--bf16")
    assert_series(got["losses"], reference["losses"], "bf16 losses per step", rtol=0, atol=BF16_LOSS_ATOL)
    assert_series([got["eval_after"]], [reference["eval_after"]], "bf16 evaluation loss", rtol=0, atol=BF16_LOSS_ATOL)
    initial = initial_weights()
    moved = torch.cat([(w - initial[n]).flatten() for n, w in saved_weights(got).items()])
    moved_reference = torch.cat([(w - initial[n]).flatten() for n, w in saved_weights(reference).items()])
    assert moved_reference.norm() > 0.1, "the reference run did not train"
    cosine = torch.nn.functional.cosine_similarity(moved, moved_reference, dim=0)
    ratio = moved.norm() / moved_reference.norm()
    assert cosine > 0.95 and 0.8 < ratio < 1.25, f"bf16 update: cosine {cosine:.3f} with the reference's, norm ratio {ratio:.3f}"


@pytest.mark.extended
def test_autotp_matches_the_plain_trainer(run: Runs) -> None:
    """``tensor_parallel.autotp_size: 2`` (DeepSpeedExamples' ``training/tensor_parallel/hf_integration``) on two
    ranks, ZeRO-2, a Llama: both ranks of the TP group read the same batches (the Trainer's data-parallel degree is
    1), the transformers-filled ``train_batch_size`` counts the DP groups, and ``save_model`` writes the whole model
    gathered from the TP shards; all as one process with the same global batches."""
    got = run("dscompile", ZERO2_AUTOTP, "--model", "llama")
    assert_matches_one_process(got, run("hf", None, "--model", "llama", world=1))


@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="DeepSpeed is not installed")
def test_autotp_matches_deepspeed(run: Runs) -> None:
    """The same AutoTP run against the unmodified script driving DeepSpeed's AutoTP through the Trainer."""
    deepspeed = run("hf", ZERO2_AUTOTP, "--model", "llama")
    got = run("dscompile", ZERO2_AUTOTP, "--model", "llama")
    assert_series(got["losses"], deepspeed["losses"], "losses per step against DeepSpeed AutoTP")
    assert_series(got["grad_norms"], deepspeed["grad_norms"], "gradient norms against DeepSpeed AutoTP")
    assert_series([got["eval_after"]], [deepspeed["eval_after"]], "evaluation loss against DeepSpeed AutoTP")
    assert_same_weights(got, deepspeed)


def initial_weights() -> dict[str, torch.Tensor]:
    spec = importlib.util.spec_from_file_location("trainer_clm", SCRIPTS / SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {name: p.detach() for name, p in module.build_model("gpt2").named_parameters()}


@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="DeepSpeed is not installed")
def test_config_optimizer_and_scheduler_match_deepspeed(run: Runs) -> None:
    """The config's AdamW and WarmupDecayLR with every value "auto": the same run as the Trainer driving DeepSpeed."""
    deepspeed = run("hf", ZERO2_OPTIMIZER_SCHEDULER)
    got = run("dscompile", ZERO2_OPTIMIZER_SCHEDULER)
    assert_series(got["losses"], deepspeed["losses"], "losses per step against DeepSpeed")
    assert_series(got["grad_norms"], deepspeed["grad_norms"], "gradient norms against DeepSpeed")
    assert_series(got["learning_rates"], deepspeed["learning_rates"], "learning rates against DeepSpeed", rtol=1e-6, atol=0)
    assert_series([got["eval_after"]], [deepspeed["eval_after"]], "evaluation loss against DeepSpeed")
    assert_same_weights(got, deepspeed)


@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="DeepSpeed is not installed")
def test_resumes_a_run_deepspeed_started(run: Runs) -> None:
    """A run the Trainer started on DeepSpeed (ZeRO-2, the Trainer's own scheduler, saved by DeepSpeed's Trainer path
    in ``scheduler.pt``) continues under dscompile from its ``checkpoint-2`` as it would have on DeepSpeed."""
    deepspeed = run("hf", ZERO2, "--save_steps", "2")
    resumed = run("dscompile", ZERO2, "--resume", str(Path(deepspeed["output_dir"]) / "checkpoint-2"))
    assert_series(resumed["losses"][2:], deepspeed["losses"][2:], "losses after resuming DeepSpeed's run")
    assert_series(resumed["learning_rates"], deepspeed["learning_rates"], "learning rates after resuming", rtol=1e-6, atol=0)
    assert_series([resumed["eval_after"]], [deepspeed["eval_after"]], "evaluation loss after resuming DeepSpeed's run")
    assert_same_weights(resumed, deepspeed)
