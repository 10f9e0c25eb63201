"""The ``compression_training`` section: DeepSpeed's keys and defaults, module matching, the schedule."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dscompile.config import load_config
from dscompile.errors import DSCompileConfigError
from dscompile.passes.compression import assign_modules, matching_modules, parse_compression
from dscompile.runtime.compression.state import WeightQuantSpec


def wq(groups: dict, **shared) -> dict:
    return {"weight_quantization": {"shared_parameters": {"enabled": True, **shared}, "different_groups": groups}}


def test_defaults_are_deepspeeds() -> None:
    section = parse_compression({})
    assert section.enabled_techniques() == [] and not section.layer_reduction.enabled
    shared = section.weight_quantization.shared
    assert (shared.schedule_offset, shared.quantize_groups, shared.quantization_type, shared.rounding) == (0, 1, "symmetric", "nearest")
    assert (shared.quantize_weight_in_forward, shared.quantizer_kernel, shared.fp16_mixed_quantize.quantize_change_ratio) == (False, False, 0.001)
    act = section.activation_quantization.shared
    assert (act.quantization_type, act.range_calibration, act.schedule_offset) == ("symmetric", "dynamic", 1000)
    sparse = section.sparse_pruning.shared
    assert (sparse.method, sparse.schedule_offset, sparse.schedule_offset_end, sparse.block_pattern, sparse.dense_ratio) == ("l1", 1000, 1000, "4x1", 0.1)
    assert section.head_pruning.shared.method == "topk" and section.row_pruning.shared.method == "l1"
    assert section.channel_pruning.shared.schedule_offset == 1000
    group = parse_compression(wq({"g": {"params": {"start_bits": 8, "target_bits": 4}}})).weight_quantization.groups[0]
    assert group.modules == ["*"] and group.params.quantization_period == 1 and group.related_modules is None


def test_section_is_accepted_by_load_config() -> None:
    config = load_config({"compression_training": wq({"g": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["fc"]}})})
    assert config.sections["compression_training"].enabled_techniques() == ["weight_quantization"]


@pytest.mark.parametrize(
    "section,key",
    [
        ({"weight_quantisation": {}}, "compression_training.weight_quantisation"),
        (wq({}), "compression_training.weight_quantization.different_groups"),
        (wq({"g": {"params": {"start_bits": 4, "target_bits": 8}}}), "start_bits"),
        (wq({"g": {"params": {"start_bits": 8, "target_bits": 0}}}), "target_bits"),
        (wq({"g": {"params": {"start_bits": 8, "target_bits": 2}}}, quantization_type="asymmetric"), "quantization_type"),
        (wq({"g": {"params": {"start_bits": 8, "target_bits": 1}}}, rounding="stochastic"), "rounding"),
        (wq({"g": {"params": {"start_bits": 8}}}), "target_bits"),
        (wq({"g": {"params": {"start_bits": 8, "target_bits": 8}, "moduels": ["x"]}}), "moduels"),
        (wq({"g": {"params": {"start_bits": 8, "target_bits": 8}, "modules": ["("]}}), "modules"),
        ({"activation_quantization": {"shared_parameters": {"enabled": True}, "different_groups": {"a": {"params": {"bits": 6}}}}}, "bits"),
        (wq({"g": {"params": {"start_bits": 8, "target_bits": 4, "quantization_period": -1}}}), "quantization_period"),
        ({"sparse_pruning": {"shared_parameters": {"method": "snip_momentum", "block_pattern": "4by1"}}}, "block_pattern"),
        ({"head_pruning": {"shared_parameters": {"enabled": True}, "different_groups": {}}}, "num_heads"),
        ({"row_pruning": {"shared_parameters": {"method": "snip_momentum"}}}, "method"),
        (
            {
                "row_pruning": {
                    "shared_parameters": {"enabled": True},
                    "different_groups": {"r": {"params": {"dense_ratio": 0.5}, "modules": ["a", "b"], "related_modules": [["c"]]}},
                }
            },
            "related_modules",
        ),
        (
            {"weight_quantization": {"different_groups": {"g": {"params": {"start_bits": 8, "target_bits": 8}, "related_modules": [["x"]]}}}},
            "related_modules",
        ),
        ({"layer_reduction": {"enabled": True, "module_name_prefix": "layers", "teacher_layer": [0, 2], "keep_number_layer": 3}}, "keep_number_layer"),
    ],
)
def test_bad_sections_name_the_key(section: dict, key: str) -> None:
    with pytest.raises(DSCompileConfigError) as info:
        parse_compression(section)
    assert key in str(info.value)


@pytest.mark.parametrize(
    "shared,key",
    [
        ({"method": "l1", "block_pattern": "2x2"}, "block_pattern"),
        ({"method": "topk", "schedule_offset": 5, "schedule_offset_end": 9}, "schedule_offset_end"),
        ({"method": "l1", "excluded_modules": ["classifier"]}, "excluded_modules"),
    ],
)
def test_snip_momentum_settings_of_other_methods_are_ignored_with_a_warning(shared: dict, key: str, caplog: pytest.LogCaptureFixture) -> None:
    """DeepSpeed reads them for snip_momentum only and ignores them otherwise: accepted, and the warning names the key."""
    section = {"sparse_pruning": {"shared_parameters": {"enabled": True, **shared}, "different_groups": {"s": {"params": {"dense_ratio": 0.5}}}}}
    with caplog.at_level("WARNING", logger="dscompile.passes.compression"):
        parsed = parse_compression(section)
    assert f"sparse_pruning.shared_parameters.{key} is ignored" in caplog.text
    assert parsed.sparse_pruning.shared.schedule_offset_end == parsed.sparse_pruning.shared.schedule_offset


def test_quantization_period_zero_is_accepted() -> None:
    """DeepSpeed's own example configs use quantization_period 0 (with start_bits == target_bits)."""
    group = {"g": {"params": {"start_bits": 1, "target_bits": 1, "quantization_period": 0}, "modules": ["fc"]}}
    parsed = parse_compression(wq(group, quantize_weight_in_forward=True))
    assert parsed.weight_quantization.groups[0].params.quantization_period == 0


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.encoder = nn.ModuleList(nn.ModuleDict({"query": nn.Linear(8, 8), "out": nn.Linear(8, 8)}) for _ in range(2))
        self.conv = nn.Conv2d(2, 4, 3)
        self.bn = nn.BatchNorm2d(4)


def test_module_names_match_with_deepspeeds_rules() -> None:
    net = Net()
    every = ["embed", "encoder.0.query", "encoder.0.out", "encoder.1.query", "encoder.1.out", "conv"]
    assert matching_modules(net, "*", (nn.Linear, nn.Conv2d, nn.Embedding)) == every
    assert matching_modules(net, "query", (nn.Linear,)) == ["encoder.0.query", "encoder.1.query"]  # re.search, anywhere
    assert matching_modules(net, r"encoder\.1", (nn.Linear,)) == ["encoder.1.query", "encoder.1.out"]
    assert matching_modules(net, "^out", (nn.Linear,)) == []
    assert matching_modules(net, "*", (nn.Linear,)) == every[1:5]  # only the kinds a technique supports


def test_module_assignment_errors() -> None:
    net = Net()
    params = {"params": {"start_bits": 8, "target_bits": 8}}
    twice = parse_compression(wq({"a": {**params, "modules": ["query"]}, "b": {**params, "modules": [r"encoder\.0"]}}))
    with pytest.raises(DSCompileConfigError, match="already compressed by group 'a'"):
        assign_modules(net, twice)
    rows = {
        "row_pruning": {
            "shared_parameters": {"enabled": True},
            "different_groups": {"r": {"params": {"dense_ratio": 0.5}, "modules": ["query"], "related_modules": [["out|embed"]]}},
        }
    }
    assignments = assign_modules(net, parse_compression(rows))
    assert [(a.module, a.related) for a in assignments] == [("encoder.0.query", ["encoder.0.out"]), ("encoder.1.query", ["encoder.1.out"])]
    rows["row_pruning"]["different_groups"]["r"]["related_modules"] = [[r"encoder\.0\.out"]]
    with pytest.raises(DSCompileConfigError, match="matches 1 modules for the 2"):
        assign_modules(net, parse_compression(rows))
    channels = {
        "channel_pruning": {
            "shared_parameters": {"enabled": True},
            "different_groups": {"c": {"params": {"dense_ratio": 0.5}, "modules": ["conv"], "related_modules": [["bn"]]}},
        }
    }
    assert [(a.module, a.related) for a in assign_modules(net, parse_compression(channels))] == [("conv", ["bn"])]


def test_patterns_matching_nothing_are_ignored_as_deepspeed_ignores_them(caplog: pytest.LogCaptureFixture) -> None:
    """DeepSpeed skips a ``modules`` or ``related_modules`` entry that matches no module (its CIFAR config
    names ``bn1`` layers that a ResNet built without batch norm lacks); the warning names the pattern."""
    net = Net()
    params = {"params": {"start_bits": 8, "target_bits": 8}}
    with caplog.at_level("WARNING", logger="dscompile.passes.compression"):
        assigned = assign_modules(net, parse_compression(wq({"a": {**params, "modules": ["decoder", "query"]}})))
    assert [a.module for a in assigned] == ["encoder.0.query", "encoder.1.query"]
    assert "pattern 'decoder' matches no module, ignored" in caplog.text
    channels = {
        "channel_pruning": {
            "shared_parameters": {"enabled": True},
            "different_groups": {"c": {"params": {"dense_ratio": 0.5}, "modules": ["conv"], "related_modules": [["bn", "norm"]]}},
        }
    }
    caplog.clear()
    with caplog.at_level("WARNING", logger="dscompile.passes.compression"):
        assigned = assign_modules(net, parse_compression(channels))
    assert [(a.module, a.related) for a in assigned] == [("conv", ["bn"])]
    assert "related_modules: pattern 'norm' matches no module, ignored" in caplog.text


# --------------------------------------------------------------------------------------------
# the bit schedule against a transcription of DeepSpeed's MoQ quantizer (runtime/quantize.py)
# --------------------------------------------------------------------------------------------
class DeepSpeedMoQ:
    """DeepSpeed's Quantizer bookkeeping: one ``quantize()`` per step from the enabling step on."""

    def __init__(self, start: int, target: int, period: int, change_ratio: float) -> None:
        self.start_bits, self.target_bits, self.q_period = start, target, period
        self.qsteps, self.real_ratio, self.change_ratio = 0, 1.0, change_ratio

    def quantize(self) -> tuple[int, float]:
        self.qsteps += 1
        if self.real_ratio > 0:  # update_fp16_ratio
            self.real_ratio -= self.change_ratio
        else:
            self.real_ratio = 0.0
        if self.start_bits != self.target_bits and self.qsteps >= self.q_period:  # compute_quantization
            self.real_ratio = 1.0
            self.q_period <<= 1
            self.start_bits -= 1
        return self.start_bits, self.real_ratio


@pytest.mark.parametrize(
    "start,target,period,offset", [(8, 4, 2, 0), (12, 8, 50, 0), (8, 4, 1, 5), (4, 4, 3, 2), (8, 1, 3, 0), (4, 4, 0, 0), (8, 4, 0, 0), (8, 1, 0, 2)]
)
def test_moq_bit_schedule_equals_deepspeeds(start: int, target: int, period: int, offset: int) -> None:
    spec = WeightQuantSpec("g", start, target, period, offset, False, True, False, 1, True, 0.01)
    moq = DeepSpeedMoQ(start, target, period, 0.01)
    for step in range(800):
        if step < offset:
            assert spec.bits_at(step) is None
            continue
        bits, ratio = moq.quantize()  # DeepSpeed quantizes before the forward of each step from offset on
        assert spec.bits_at(step) == bits, step
        assert spec.real_ratio_at(step) == pytest.approx(max(ratio, 0.0), abs=1e-9), step


def test_quantize_weight_in_forward_uses_target_bits_from_the_offset() -> None:
    spec = WeightQuantSpec("g", 8, 4, 2, 3, True, True, False, 1, False, 0.0)
    assert [spec.bits_at(s) for s in range(6)] == [None, None, None, 4, 4, 4]
    assert torch.tensor(0.0).item() == spec.real_ratio_at(4)
