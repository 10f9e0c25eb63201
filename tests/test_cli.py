"""The ``dscompile`` command line: dump formats, pass listing, demo, and one-line errors."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from dscompile.cli import main


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dscompile.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_dump_text_of_zoo_target(tmp_path, capsys):
    assert main(["dump", "dscompile.zoo.targets:mlp", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "== graph_0.forward after lower ==" in out and "def forward" in out  # the last step: the graph the lowering got
    assert "graph_0.backward" in out  # the summary table lists every graph
    assert (tmp_path / "graph_0.html").is_file()
    assert "== graph_0.forward: lowering ==\nlowering: eager\nwhy: lower: eager, as configured" in out  # the dump's default lowering, stated


def test_dump_table_after_a_pass_with_pipeline(tmp_path, capsys):
    code = tmp_path / "model.py"
    code.write_text(
        textwrap.dedent(
            """
            import torch

            def factory():
                model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
                return model, (torch.randn(2, 4),)
            """
        )
    )
    out_dir = tmp_path / "dump"
    assert main(["dump", f"{code}:factory", "--pipeline", "cse,dce,lower(eager)", "--after", "captured", "--format", "table", "--out", str(out_dir)]) == 0
    out = capsys.readouterr().out
    assert "after captured" in out and "aten.tanh" in out


def test_dump_dot_and_html(tmp_path, capsys):
    assert main(["dump", "dscompile.zoo.targets:mlp", "--format", "dot", "--out", str(tmp_path / "a")]) == 0
    assert "digraph" in capsys.readouterr().out
    assert main(["dump", "dscompile.zoo.targets:mlp", "--format", "html", "--inference", "--out", str(tmp_path / "b")]) == 0
    assert capsys.readouterr().out.strip().endswith("graph_0.html")


@pytest.mark.parametrize(
    "target,message",
    [
        ("missing.py:factory", "does not exist"),
        ("no_colon_here", "must be"),
        ("dscompile.zoo.targets:nothing", "has no attribute 'nothing'"),
        ("not_a_module_xyz:factory", "cannot import module"),
        ("dscompile.zoo:build", "raised"),
    ],
)
def test_bad_target_is_one_clear_line(target, message):
    result = _run("dump", target)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_bad_after_pass_suggests(capsys):
    assert main(["dump", "dscompile.zoo.targets:mlp", "--after", "dcee"]) == 2
    assert "did you mean 'dce'" in capsys.readouterr().err


def test_passes_lists_options_and_docs(capsys):
    assert main(["passes"]) == 0
    out = capsys.readouterr().out
    for name in ("cse", "dce", "noop_views", "lower"):
        assert f"\n{name}  [" in "\n" + out
    assert "backend: str = 'auto'" in out and "lowerings:" in out


@pytest.mark.slow
def test_demo_command_runs():
    result = _run("demo", "--steps", "2", "--lower", "eager")
    assert result.returncode == 0, result.stderr
    assert "eager loss" in result.stdout and "graph_0.backward" in result.stdout


@pytest.mark.slow
def test_dump_with_triton_lowering_shows_regions_without_interpreter_env(tmp_path):
    """On a CPU without TRITON_INTERPRET set, the Triton lowering switches the interpreter on itself."""
    import json
    import os

    import torch

    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"lower": "triton"}))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = ["dump", "dscompile.zoo.targets:mlp", "--config", str(config), "--format", "table", "--out", str(tmp_path / "d")]
    result = subprocess.run(
        [sys.executable, "-m", "dscompile.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "graph_0.forward: fusion regions and the nodes left out" in result.stdout
    assert "skipped addmm: aten.addmm: matmul/convolution stays a library call" in result.stdout
    # CPU tensors: kernels run in the interpreter without a GPU; with one, the regions stay aten.
    assert (tmp_path / "d" / "graph_0.forward" / "kernels").is_dir() != torch.cuda.is_available()
