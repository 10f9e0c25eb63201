"""Test-session set-up: Triton runs in its interpreter when there is no GPU, Dynamo starts clean."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The repository's own folders ``kernels/``, ``passes/`` and ``backends/`` install as
# ``dscompile.kernels`` etc.; seen from the repository root (``python -m pytest`` puts it on
# sys.path) they would shadow top-level packages of the same name, e.g. Hugging Face's ``kernels``
# that transformers >= 5.25 imports. Tests import the installed package, never the bare folders.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]

# One C++ compile at a time per process. Inductor's default starts a pool of compile workers in every process that
# compiles (each worker imports torch); here each xdist worker and each rank of a distributed test compiles, on two
# cores, so the pool only adds start-up and contention: without it a DeepSpeed-script file took 31% less CPU with
# warm caches and 20% less with cold ones. The generated code is the same. Rank subprocesses inherit the setting.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        # Must happen before anything imports triton.
        os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

# DeepSpeed 0.19.5, the last release with deepspeed.compression, lives apart from the installed 0.19.8
# (README: ``pip install --no-deps --upgrade --target .deepspeed-0.19.5 deepspeed==0.19.5``). Tests that
# compare with it put $DSCOMPILE_DEEPSPEED_0195 on a subprocess's PYTHONPATH; that folder is its default.
_DEEPSPEED_0195 = _ROOT / ".deepspeed-0.19.5"
if "DSCOMPILE_DEEPSPEED_0195" not in os.environ and _DEEPSPEED_0195.is_dir():
    os.environ["DSCOMPILE_DEEPSPEED_0195"] = str(_DEEPSPEED_0195)

# .ci/run sets DSCOMPILE_REQUIRE_DEEPSPEED=1: there a test skipped for want of DeepSpeed (a reason that
# names it) fails the run, so the comparisons with DeepSpeed cannot quietly stop running.
_REQUIRE_DEEPSPEED = os.environ.get("DSCOMPILE_REQUIRE_DEEPSPEED", "") not in ("", "0")
_DEEPSPEED_SKIPS: list[str] = []


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch, so cached graphs of one test never serve another."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def pytest_configure(config):
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    if hasattr(config.option, "loadscopereorder"):
        # pytest-xdist's loadfile sorts files by their number of tests unless told not to, which overrode
        # LONGEST_FILES: the 8-test Trainer file (the longest) started an hour into a full run
        config.option.loadscopereorder = False


def pytest_runtest_logreport(report):
    if _REQUIRE_DEEPSPEED and report.skipped:
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if "deepspeed" in reason.lower():
            _DEEPSPEED_SKIPS.append(f"{report.nodeid}: {reason}")


def pytest_sessionfinish(session, exitstatus):
    if _DEEPSPEED_SKIPS and not hasattr(session.config, "workerinput") and session.exitstatus == 0:
        session.exitstatus = 1  # pytest-xdist's workers report to the controller, which decides


def pytest_terminal_summary(terminalreporter):
    if _DEEPSPEED_SKIPS:
        terminalreporter.section("skipped for want of DeepSpeed (DSCOMPILE_REQUIRE_DEEPSPEED=1: this fails the run)")
        for line in _DEEPSPEED_SKIPS:
            terminalreporter.write_line(line)


def pytest_collection_modifyitems(config, items):
    """Longest files first; tests marked ``gpu`` skipped, with the reason, where there is no CUDA."""
    _longest_files_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marked gpu); bench/gpu_check.py runs these on a GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# The files that take longest (their tests' summed times without the extended cases, CI's run of 2026-12-07 evening on 2
# cores, Inductor's cache partly warm), longest first.
# ``pytest -n auto --dist loadfile`` hands files to workers in collection order (with xdist's reordering by test
# count turned off in pytest_configure), so starting these first
# keeps one worker from finishing a long file alone at the end while the others idle.
LONGEST_FILES = (
    "test_hf_trainer.py",  # 505 s
    "test_compression_examples.py",  # 458 s
    "test_deepspeed_scripts_lm.py",  # 440 s
    "test_deepspeed_scripts.py",  # 321 s
    "test_zero_offload_param.py",  # 316 s
    "test_zero_offload.py",  # 298 s
    "test_sequence_parallel.py",  # 232 s
    "test_deepspeed_scripts_inference.py",  # 226 s
    "test_inference_tensor_parallel.py",  # 222 s
    "test_tensor_parallel.py",  # 221 s
    "test_checkpointing_budget.py",  # 203 s
    "test_deepspeed_scripts_generation.py",  # 186 s
    "test_pipeline_parallel_distributed.py",  # 168 s
    "test_capabilities_lowered.py",  # 166 s
    "test_hf_training_idioms.py",  # 159 s
    "test_zero_offload_overlap.py",  # 153 s
    "test_checkpointing_hf.py",  # 152 s
    "test_tensor_parallel_pipeline.py",  # 146 s
    "test_onebit_engine.py",  # 145 s
    "test_tensor_parallel_checkpoint.py",  # 143 s
    "test_zero_features.py",  # 135 s
    "test_onebit_optimizers.py",  # 126 s
    "test_inference.py",  # 119 s
    "test_mixed_precision_zero.py",  # 115 s
    "test_tensor_parallel_sequence.py",  # 112 s
    "test_notebooks.py",  # 108 s
    "test_engine_api.py",  # 95 s
    "test_zero3_param_attributes.py",  # 93 s
    "test_cli.py",  # 92 s
    "test_tensor_parallel_kv_replication.py",  # 89 s
    "test_gpu_check.py",  # 84 s
    "test_model_parallel_hf_calls.py",  # 80 s
    "test_tensor_parallel_pipeline_layouts.py",  # 78 s
    "test_compression_clean.py",  # 76 s
    "test_checkpointing.py",  # 75 s
    "test_tensor_parallel_compose.py",  # 74 s
    "test_distributed_harness.py",  # 74 s
    "test_sparse_attention_op.py",  # 72 s
    "test_zero.py",  # 71 s
    "test_compression_engine.py",  # 69 s
    "test_inference_decode_paths.py",  # 66 s
    "test_compression_passes.py",  # 66 s
    "test_inference_kernels.py",  # 63 s
    "test_distributed_attention.py",  # 62 s
    "test_lowering_regressions.py",  # 61 s
    "test_checkpointing_distributed.py",  # 58 s
    "test_mixed_precision.py",  # 58 s
    "test_checkpointing_memory.py",  # 56 s
    "test_sparse_attention_pass.py",  # 54 s
    "test_dropout_training.py",  # 52 s
    "test_inference_triton_kernels.py",  # 51 s
    "test_compression_deepspeed.py",  # 51 s
    "test_onebit_lamb_zero.py",  # 50 s
)


def _longest_files_first(items: list) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), order[id(item)]))
