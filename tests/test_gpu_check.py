"""``bench/gpu_check.py``: its dry run covers every section on a CPU, and its fits and ratios are right.

The GPU check is run once per lent GPU (15 minutes, no second try to spare), so its script is proven here: the
dry run (tiny sizes, Triton in its interpreter, ``aot_eager`` / ``lower: eager`` in place of Inductor's CPU
compiles) must finish with every goal's ratio rows present and no ERROR, and write the table, its JSON and
the ZeRO-3 profiler trace.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from gpucheck.common import Table, fit_line, overlap_fraction  # noqa: E402  (bench/gpucheck)


def test_fit_line_recovers_a_line_and_scores_scatter() -> None:
    slope, intercept, r2 = fit_line([1, 2, 3, 4], [3.0, 5.0, 7.0, 9.0])
    assert (slope, intercept, r2) == pytest.approx((2.0, 1.0, 1.0))
    _, _, r2 = fit_line([1, 2, 3, 4], [1.0, 4.0, 1.0, 4.0])
    assert r2 < 0.5


def test_overlap_fraction_counts_covered_communication_time() -> None:
    comm = [(0.0, 10.0), (20.0, 30.0)]
    compute = [(5.0, 12.0), (8.0, 25.0)]  # overlapping compute intervals are merged, not counted twice
    assert overlap_fraction(comm, compute) == pytest.approx((5 + 5) / 20)
    assert overlap_fraction([], compute) is None


def test_ratio_rows_carry_the_median_range_and_verdict(tmp_path: Path) -> None:
    table = Table(out=tmp_path / "t.txt")
    low = table.ratio("s", "a / b", [0.9, 1.1, 0.95], "<= 1.0")
    high = table.ratio("s", "longest", [12.0], ">= 10.0", bound=">=")
    assert (low.median, low.low, low.high, low.meets) == (0.95, 0.9, 1.1, True)
    assert high.meets and high.cell() == ">=12.00x"
    assert table.ratio("s", "none", []) is None
    saved = json.loads((tmp_path / "t.json").read_text())
    assert [r["case"] for r in saved["rows"]] == ["a / b", "longest", "none"]
    assert "(<= 1.0: meets)" in (tmp_path / "t.txt").read_text()


GOAL_ROWS = {
    "lowering": ["gpt (15k) train step: dscompile default / torch.compile", "gpt (15k) no_grad forward: dscompile default / torch.compile",
                 "train step: dscompile default / torch.compile", "no_grad forward: dscompile default / torch.compile"],
    "sparse attn": ["128: dense SDPA / ours", "128: FlexAttention / ours", "128: linear fit of time on nonzero blocks", "longest: ours / dense math"],
    "zero3 bf16": ["dscompile / fsdp2 step time", "gpt: dscompile step trace"],
    "decode": ["dscompile fp32 / hf eager", "dscompile int8 / hf static + torch.compile", "deepspeed kernel inject"],
}


@pytest.mark.slow
def test_dry_run_exercises_every_section(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.txt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--cpu-dry-run", "--skip-tests", "--budget", "1200", "--out", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["device"].startswith("CPU") and result["torch"] and result["triton"]
    rows = result["rows"]
    assert not [r for r in rows if r["value"] in ("ERROR", "skipped")], [r for r in rows if r["value"] in ("ERROR", "skipped")]
    for section, cases in GOAL_ROWS.items():
        found = [r["case"] for r in rows if r["section"] == section]
        for case in cases:
            assert any(case in f for f in found), (section, case, found)
    ratios = [r for r in rows if r["ratio"]]
    assert ratios and all(r["ratio"]["median"] > 0 for r in ratios)
    assert {r["section"] for r in rows} >= {"lowering", "sparse", "zero3", "decode", "kernels", "total"}
    assert (tmp_path / "zero3_dscompile_trace.json").stat().st_size > 0
    assert out.read_text().startswith("device: CPU")
