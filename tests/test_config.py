"""Config parsing: DeepSpeed keys, typed validation, helpful errors, unbuilt capabilities refused."""

from __future__ import annotations

import json

import pytest

from dscompile.config import load_config
from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError


def test_deepspeed_keys_parse_to_typed_fields():
    cfg = load_config(
        {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2,
            "gradient_clipping": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "steps_per_print": 5,
        }
    )
    assert cfg.train_micro_batch_size_per_gpu == 4
    assert cfg.gradient_clipping == 1.0 and isinstance(cfg.gradient_clipping, float)
    assert cfg.optimizer.type == "AdamW" and cfg.optimizer.params == {"lr": 1e-3}
    cfg.resolve_batch_sizes(world_size=1)
    assert cfg.train_batch_size == 8


def test_unknown_key_names_key_and_suggests_close_match():
    with pytest.raises(DSCompileConfigError) as info:
        load_config({"gradient_clippin": 1.0})
    assert info.value.key == "gradient_clippin"
    assert "gradient_clipping" in str(info.value)


def test_unknown_nested_key_has_dotted_path():
    with pytest.raises(DSCompileConfigError) as info:
        load_config({"optimizer": {"type": "Adam", "parms": {}}})
    assert info.value.key == "optimizer.parms"
    assert "params" in str(info.value)


@pytest.mark.parametrize(
    "config,key",
    [
        ({"gradient_clipping": "big"}, "gradient_clipping"),
        ({"train_micro_batch_size_per_gpu": 2.5}, "train_micro_batch_size_per_gpu"),
        ({"debug": "yes"}, "debug"),
        ({"lower": "tritn"}, "lower"),
        ({"optimizer": {"type": 3}}, "optimizer.type"),
        ({"gradient_clipping": -1.0}, "gradient_clipping"),
    ],
)
def test_wrong_types_name_the_key(config, key):
    with pytest.raises(DSCompileConfigError) as info:
        load_config(config)
    assert info.value.key == key


def test_lower_typo_suggests():
    with pytest.raises(DSCompileConfigError, match="inductor"):
        load_config({"lower": "inductr"})


def test_batch_size_contradiction():
    cfg = load_config({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})
    with pytest.raises(DSCompileConfigError) as info:
        cfg.resolve_batch_sizes(world_size=1)
    assert info.value.key == "train_batch_size"


def test_batch_size_derivation_across_ranks():
    cfg = load_config({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2})
    cfg.resolve_batch_sizes(world_size=4)
    assert cfg.gradient_accumulation_steps == 2


def test_prescale_and_predivide_contradict():
    with pytest.raises(DSCompileConfigError) as info:
        load_config({"prescale_gradients": True, "gradient_predivide_factor": 2.0})
    assert info.value.key == "gradient_predivide_factor"


@pytest.mark.parametrize(
    "config,key",
    [
        ({"tensor_parallel": {"autotp_size": 2, "vocab_parallel_ce_backend": "fused"}}, "tensor_parallel.vocab_parallel_ce_backend"),
        ({"data_efficiency": {"enabled": True}}, "data_efficiency.enabled"),
        ({"flops_profiler": {"enabled": True}}, "flops_profiler.enabled"),
        ({"sparse_gradients": True}, "sparse_gradients"),
    ],
)
def test_unbuilt_capabilities_are_refused_not_ignored(config, key):
    with pytest.raises(DSCompileNotSupportedError) as info:
        load_config(config)
    assert info.value.key == key
    assert "not supported yet" in str(info.value)


def test_disabled_unbuilt_sections_are_accepted():
    load_config({"flops_profiler": {"enabled": False}, "tensorboard": {"enabled": False}})


def test_config_from_path_and_overrides(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"gradient_clipping": 0.5, "steps_per_print": 3}))
    cfg = load_config({"config": str(path), "steps_per_print": 7})
    assert cfg.gradient_clipping == 0.5 and cfg.steps_per_print == 7
    assert load_config(str(path)).steps_per_print == 3


def test_missing_or_bad_config_file(tmp_path):
    with pytest.raises(DSCompileConfigError, match="does not exist"):
        load_config({"config": str(tmp_path / "nope.json")})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DSCompileConfigError, match="not valid JSON"):
        load_config(str(bad))


def test_textual_pipeline_is_checked_at_load():
    with pytest.raises(DSCompileConfigError) as info:
        load_config({"pipeline": "cse,dcee"})
    assert info.value.key == "pipeline" and "dce" in str(info.value)


def test_pipeline_dict_is_deepspeeds_pipeline_parallel_section():
    # A dict under "pipeline" is DeepSpeed's pipeline-parallel config, not a pass spec.
    config = load_config({"pipeline": {"stages": 2}})
    assert config.pipeline is None
    assert config.sections["pipeline_parallel"].stages == 2
    with pytest.raises(DSCompileConfigError) as info:
        load_config({"pipeline": {"stagse": 2}})
    assert "stages" in str(info.value)


def test_environment_fills_dump_and_lower(monkeypatch, tmp_path):
    monkeypatch.setenv("DSCOMPILE_DUMP", str(tmp_path))
    monkeypatch.setenv("DSCOMPILE_LOWER", "eager")
    cfg = load_config({})
    assert cfg.dump == str(tmp_path) and cfg.lower == "eager"
    monkeypatch.setenv("DSCOMPILE_LOWER", "nonsense")
    with pytest.raises(DSCompileConfigError):
        load_config({})
