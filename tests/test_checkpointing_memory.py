"""Measured peak memory of a training step falls with checkpointing (each policy in its own process).

Peak resident memory is read from /proc/self/status (VmHWM) after resetting it through
/proc/self/clear_refs, so the compile's own peak (warm-up step) is excluded. Activations are
several MiB each, so glibc serves them with mmap and returns them on free: RSS follows them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = r"""
import gc, json, sys, torch
from dscompile.zoo import build
ac = json.loads(sys.argv[1])
torch.set_num_threads(1)
case = build("gpt", d_model=256, n_heads=4, seq_len=256, vocab_size=256, n_layers=4, batch_size=8)
model = torch.compile(case.model, backend="dscompile", options={"lower": "eager", "activation_checkpointing": ac})
batch = case.batch()

def step():
    model(*batch).backward()
    for p in case.model.parameters():
        p.grad = None

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

step()  # compile and warm up
gc.collect()
before = rss("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
step()
print(json.dumps({"peak_delta": rss("VmHWM:") - before}))
"""


def _peak(ac: dict) -> int:
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(ac)], capture_output=True, text=True, timeout=600, cwd=root, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_delta"]


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc/self/clear_refs to reset the peak RSS")
def test_peak_memory_of_a_step_falls_with_checkpointing() -> None:
    none = _peak({"policy": "none"})
    half = _peak({"memory_budget": 0.5})
    full = _peak({"policy": "full"})
    # measured here: ~110 MiB without checkpointing, ~45 MiB at budget 0.5, ~22 MiB with full
    assert full < 0.6 * none, (none, half, full)
    assert half < 0.9 * none, (none, half, full)
