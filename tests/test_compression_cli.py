"""``dscompile compress TARGET --config F``: sizes before and after, output errors, a loadable result."""

from __future__ import annotations

import json
import re

import torch

from dscompile.cli import main

CONFIG = {
    "compression_training": {
        "weight_quantization": {
            "shared_parameters": {"enabled": True, "schedule_offset": 0, "quantize_groups": 1},
            "different_groups": {"all": {"params": {"start_bits": 8, "target_bits": 4, "quantization_period": 2}, "modules": ["*"]}},
        },
        "row_pruning": {
            "shared_parameters": {"enabled": True, "schedule_offset": 3},
            "different_groups": {"ffn": {"params": {"dense_ratio": 0.5}, "modules": [r"mlp\.fc"], "related_modules": [[r"mlp\.proj"]]}},
        },
    }
}


def test_compress_reports_sizes_and_errors(tmp_path, capsys) -> None:
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(CONFIG))
    saved = tmp_path / "cleaned.pt"
    assert main(["compress", "dscompile.zoo.targets:gpt", "--config", str(config), "--save", str(saved)]) == 0
    out = capsys.readouterr().out
    before, after = (int(v.replace(",", "")) for v in re.search(r"state_dict bytes: ([\d,]+) fp32 -> ([\d,]+) cleaned", out).groups())
    assert after < 0.25 * before
    # the schedule's end: 4 bits reached at step 2 * 2**3 - 1 = 15, row pruning on since step 3
    assert "schedule at step 15" in out
    graph_error = float(re.search(r"vs the compressed training graph \(schedule at step \d+\): (\S+)", out).group(1))
    assert graph_error < 1e-4
    assert "blocks.0.mlp.fc: QuantizedLinear 64x32 at 4-bit storage" in out and "blocks.0.mlp.proj: QuantizedLinear 32x64" in out
    state = torch.load(saved)
    assert state["blocks.0.mlp.fc.qweight"].shape == (64, 16) and state["blocks.0.mlp.fc.qweight"].dtype == torch.uint8


def test_compress_without_a_section_is_a_one_line_error(tmp_path, capsys) -> None:
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"compression_training": {"weight_quantization": {"shared_parameters": {"enabled": True}}}}))
    assert main(["compress", "dscompile.zoo.targets:mlp", "--config", str(config)]) == 2
    assert "different_groups" in capsys.readouterr().err
