"""DeepSpeed-style JSON/dict config → typed, validated dataclasses.

A DeepSpeed user's ``ds_config.json`` keys mean the same here. Unknown keys, wrong types and
contradictions raise ``DSCompileConfigError`` naming the key (with a close match where there is
one); keys of capabilities that are not built yet raise ``DSCompileNotSupportedError`` instead
of being ignored. Capability modules add their own sections with ``register_section``.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import math
import os
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from dscompile.errors import DSCompileConfigError, DSCompileNotSupportedError, suggest

LowerName = Literal["eager", "inductor", "triton"]

UNFILLED_AUTO = (
    'is "auto", which Hugging Face\'s Trainer and Accelerate replace with a value from their own arguments before DeepSpeed reads '
    "the config; it reached dscompile unfilled",
    "write the value here, or hand the config to the Trainer (TrainingArguments(deepspeed=...)) or Accelerate, which fill it",
)
"""Why a raw ``"auto"`` is refused, and the fix (every numeric or boolean key says the same)."""


_log = logging.getLogger("dscompile.config")
_NO_EFFECT_LOGGED: set[str] = set()


def log_no_effect(path: str, why: str) -> None:
    """A DeepSpeed key that is accepted and changes nothing here: one warning per process naming it and saying why."""
    if path in _NO_EFFECT_LOGGED:
        return
    _NO_EFFECT_LOGGED.add(path)
    _log.warning("%s has no effect in dscompile: %s", path, why)


def log_no_effect_keys(path: str, given: Any, why: Mapping[str, str]) -> None:
    """``log_no_effect`` for each key of ``why`` that the section ``given`` (its raw mapping) sets."""
    if isinstance(given, Mapping):
        for key, reason in why.items():
            if key in given:
                log_no_effect(f"{path}.{key}", reason)


def refuse_unfilled_auto(path: str, value: Any) -> None:
    """An ``"auto"`` that no Trainer filled in: refused naming the key, never compared with a number."""
    if isinstance(value, str) and value == "auto":
        raise DSCompileConfigError(path, *UNFILLED_AUTO)


def refuse_non_finite(path: str, value: Any) -> None:
    """inf and NaN make every parameter inf or NaN at the first step: refused before anything is built."""
    if isinstance(value, float) and not math.isfinite(value):
        raise DSCompileConfigError(path, f"must be a finite number, got {value!r}")


def check_hyperparameters(path: str, params: Mapping[str, Any], fn: Callable[..., Any]) -> None:
    """Check an optimizer's or scheduler's ``params`` before they reach its constructor ``fn``: an unfilled
    ``"auto"``, a string or bool where ``fn`` takes a number, and inf/NaN are refused naming ``path.key``
    (the constructor would fail comparing a str with a float, or step to inf). A list value (per group,
    or betas) is checked entry by entry."""
    numeric = numeric_parameters(fn)
    for key, value in params.items():
        where = f"{path}.{key}"
        for item in value if isinstance(value, (list, tuple)) else [value]:
            refuse_unfilled_auto(where, item)
            if key in numeric and isinstance(item, (str, bool)):
                raise DSCompileConfigError(where, f"expected a number, got {value!r}")
            refuse_non_finite(where, item)


def numeric_parameters(fn: Callable[..., Any]) -> set[str]:
    """The parameters of ``fn`` that take numbers: a number (or a tuple of them) as default, or int/float in the type hint."""
    try:
        hints = typing.get_type_hints(fn.__init__ if inspect.isclass(fn) else fn)
    except Exception:  # a hint naming something not importable here: fall back to the defaults
        hints = {}
    numeric = set()
    for name, parameter in inspect.signature(fn).parameters.items():
        default = parameter.default
        defaults = default if isinstance(default, tuple) and default else (default,)
        if all(_is_number(d) for d in defaults) or _hint_takes_number(hints.get(name)):
            numeric.add(name)
    return numeric


def _hint_takes_number(hint: Any) -> bool:
    return hint in (int, float) or any(_hint_takes_number(arg) for arg in get_args(hint))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_dataclass(cls: type, data: Any, path: str) -> Any:
    """Build dataclass ``cls`` from a dict, checking every key and value type."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise DSCompileConfigError(path, f"expected a JSON object, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            hint = suggest(key, fields)
            raise DSCompileConfigError(
                f"{path}.{key}" if path else key,
                "unknown key",
                hint or f"valid keys here: {', '.join(sorted(fields))}",
            )
        values[key] = parse_value(value, hints[key], f"{path}.{key}" if path else key)
    for f in dataclasses.fields(cls):
        capability = f.metadata.get("unbuilt")
        if capability is not None and f.name in values and values[f.name] != f.default:
            raise DSCompileNotSupportedError(f"{path}.{f.name}" if path else f.name, capability)
    try:
        obj = cls(**values)
    except TypeError as exc:
        raise DSCompileConfigError(path or "<config>", str(exc)) from None
    validate = getattr(obj, "validate", None)
    if validate is not None:
        validate(path)
    return obj


def unbuilt(default: Any, capability: str) -> Any:
    """A dataclass field for a DeepSpeed key whose capability is not built yet: accepted at its
    default (so a full DeepSpeed config loads), refused naming the key otherwise."""
    return field(default=default, metadata={"unbuilt": capability})


def parse_value(value: Any, annotation: Any, path: str) -> Any:
    """Check one config value against its annotation; ints are accepted where floats are."""
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is Any:
        return value
    if dataclasses.is_dataclass(annotation):
        return parse_dataclass(annotation, value, path)
    if origin is Literal:
        if value not in args:
            hint = suggest(str(value), [str(a) for a in args])
            raise DSCompileConfigError(path, f"{value!r} is not one of {', '.join(map(repr, args))}", hint)
        return value
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        if value is None and type(None) in args:
            return None
        last: DSCompileConfigError | None = None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return parse_value(value, arg, path)
            except DSCompileConfigError as exc:
                last = exc
        assert last is not None
        raise last
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise DSCompileConfigError(path, f"expected a list, got {type(value).__name__}")
        inner = args[0] if args else Any
        items = [parse_value(v, inner, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or annotation is dict:
        if not isinstance(value, Mapping):
            raise DSCompileConfigError(path, f"expected a JSON object, got {type(value).__name__}")
        return dict(value)
    if annotation in (bool, int, float):
        refuse_unfilled_auto(path, value)
    if annotation is bool:
        if not isinstance(value, bool):
            raise DSCompileConfigError(path, f"expected true or false, got {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise DSCompileConfigError(path, f"expected an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise DSCompileConfigError(path, f"expected a number, got {value!r}")
        refuse_non_finite(path, float(value))
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise DSCompileConfigError(path, f"expected a string, got {value!r}")
        return value
    return value


@dataclass
class OptimizerConfig:
    """``optimizer``: DeepSpeed's ``{"type": ..., "params": {...}}``."""

    type: str
    params: dict[str, Any] = field(default_factory=dict)
    legacy_fusion: bool = False  # DeepSpeed's fp16 optimizer implementation switch; the maths is the same


@dataclass
class SchedulerConfig:
    """``scheduler``: DeepSpeed's ``{"type": ..., "params": {...}}``."""

    type: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class SectionSpec:
    """How one top-level config section is parsed, and whether its capability is built."""

    key: str
    parser: Callable[[Any, str], Any] | None
    capability: str
    is_disabled: Callable[[Any], bool] = lambda value: False


_SECTIONS: dict[str, SectionSpec] = {}


def register_section(key: str, parser: Callable[[Any, str], Any], capability: str) -> None:
    """Make config section ``key`` supported, parsed by ``parser(value, path)``.

    Called by the module that implements the capability (e.g. the sparse-attention pass), so a
    capability's config and its code land together.
    """
    _SECTIONS[key] = SectionSpec(key, parser, capability)


def _disabled_by_flag(value: Any) -> bool:
    return isinstance(value, Mapping) and value.get("enabled") is False and len(value) <= 2


def _declare_unbuilt(key: str, capability: str, is_disabled: Callable[[Any], bool] = _disabled_by_flag) -> None:
    _SECTIONS.setdefault(key, SectionSpec(key, None, capability, is_disabled))


# DeepSpeed sections whose capabilities are not built yet. Present and enabled -> refused.
for _key, _capability in {
    "amp": "apex AMP",
    "quantize_training": "quantized training",
    "data_efficiency": "data efficiency",
    "curriculum_learning": "curriculum learning",
    "aio": "asynchronous NVMe I/O",
    "flops_profiler": "the DeepSpeed flops profiler (use the dump summary instead)",
    "autotuning": "autotuning",
    "elasticity": "elastic training",
    "compile": "DeepSpeed's own compile section (dscompile is the compiler)",
    "monitor": "monitoring",
    "tensorboard": "tensorboard monitoring",
    "wandb": "wandb monitoring",
    "csv_monitor": "csv monitoring",
    "comms_logger": "communication logging",
    "checkpoint": "checkpoint engine options",
    "hybrid_engine": "the hybrid engine",
    "weight_quantization": "weight quantization",
}.items():
    _declare_unbuilt(_key, _capability)
_declare_unbuilt(
    "zero_optimization",
    "ZeRO optimization",
    lambda v: isinstance(v, Mapping) and v.get("stage", 0) == 0 and set(v) <= {"stage"},
)

# Top-level scalar keys of DeepSpeed that only make sense with capabilities not built yet.
_UNBUILT_FLAGS: dict[str, tuple[Any, str]] = {
    "zero_force_ds_cpu_optimizer": (False, "ZeRO-Offload"),
    "seq_parallel_communication_data_type": (None, "sequence parallelism"),
    "sparse_gradients": (False, "sparse gradients"),
    "fp32_reduce_scatter": (False, "ZeRO optimization"),
    "dump_state": (False, "DeepSpeed state dumps"),
}


@dataclass
class DSConfig:
    """The validated config. DeepSpeed keys keep their names; dscompile's own keys are below them.

    ``sections`` holds the parsed capability sections registered with ``register_section``.
    """

    train_batch_size: int | None = None
    train_micro_batch_size_per_gpu: int | None = None
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float = 0.0
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    steps_per_print: int = 10
    wall_clock_breakdown: bool = False
    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0
    memory_breakdown: bool = False
    zero_allow_untested_optimizer: bool = False
    # dscompile's own keys
    lower: LowerName | None = None
    pipeline: str | None = None
    dump: str | None = None
    debug: bool = False
    partitioner: Literal["min_cut", "default"] = "min_cut"
    sections: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    def resolve_batch_sizes(self, world_size: int) -> None:
        """Fill the missing one of train_batch_size = micro * accumulation * world, or fail."""
        tb, mb, gas = self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps
        for key, value in (("train_batch_size", tb), ("train_micro_batch_size_per_gpu", mb), ("gradient_accumulation_steps", gas)):
            if value is not None and value <= 0:
                raise DSCompileConfigError(key, f"must be positive, got {value}")
        if tb is not None and mb is not None and gas is not None:
            if tb != mb * gas * world_size:
                raise DSCompileConfigError(
                    "train_batch_size",
                    f"{tb} != train_micro_batch_size_per_gpu ({mb}) * gradient_accumulation_steps ({gas}) * world size ({world_size})",
                    "set two of the three and let dscompile derive the third",
                )
        elif tb is not None and mb is not None:
            if tb % (mb * world_size):
                raise DSCompileConfigError("train_batch_size", f"{tb} is not divisible by micro batch {mb} * world size {world_size}")
            self.gradient_accumulation_steps = tb // (mb * world_size)
        elif tb is not None and gas is not None:
            if tb % (gas * world_size):
                raise DSCompileConfigError("train_batch_size", f"{tb} is not divisible by accumulation steps {gas} * world size {world_size}")
            self.train_micro_batch_size_per_gpu = tb // (gas * world_size)
        elif tb is not None:
            if tb % world_size:
                raise DSCompileConfigError("train_batch_size", f"{tb} is not divisible by world size {world_size}")
            self.gradient_accumulation_steps = 1
            self.train_micro_batch_size_per_gpu = tb // world_size
        else:
            self.gradient_accumulation_steps = gas or 1
            if mb is not None:
                self.train_batch_size = mb * self.gradient_accumulation_steps * world_size

    @property
    def accumulation_steps(self) -> int:
        return self.gradient_accumulation_steps or 1

    def gradient_predivisor(self, world: int) -> float:
        """What each rank divides its gradient by before the sum over ``world`` ranks (the sum is then divided by
        ``world / this``): DeepSpeed's ``prescale_gradients`` (the world size) or ``gradient_predivide_factor``.
        The mean is the same; the partial sums stay smaller, which keeps fp16 reductions from overflowing."""
        return float(world) if self.prescale_gradients else float(self.gradient_predivide_factor)


_OWN_KEYS = {f.name for f in dataclasses.fields(DSConfig)} - {"sections", "raw"}


def load_config(source: Any = None) -> DSConfig:
    """Turn what the user gave (None, dict, path, DSConfig, or ``{"config": path, ...}``) into a DSConfig.

    ``DSCOMPILE_DUMP``, ``DSCOMPILE_LOWER`` and ``DSCOMPILE_DEBUG`` in the environment fill
    the matching keys when the config does not set them.
    """
    import dscompile.pipeline as pipeline_module

    pipeline_module._ensure_builtin_passes()  # capability modules register their sections
    if isinstance(source, DSConfig):
        return source
    data = _read_source(source)
    config = _parse_top_level(data)
    env_defaults = {"dump": os.environ.get("DSCOMPILE_DUMP"), "lower": os.environ.get("DSCOMPILE_LOWER")}
    if config.dump is None and env_defaults["dump"]:
        config.dump = env_defaults["dump"]
    if config.lower is None and env_defaults["lower"]:
        config.lower = parse_value(env_defaults["lower"], LowerName, "DSCOMPILE_LOWER")
    if os.environ.get("DSCOMPILE_DEBUG", "") not in ("", "0"):
        config.debug = True
    return config


def _read_source(source: Any) -> dict[str, Any]:
    if source is None:
        return {}
    if isinstance(source, (str, os.PathLike)):
        return read_json_config(Path(source), "config")
    if not isinstance(source, Mapping):
        raise DSCompileConfigError("<config>", f"expected a dict or a path to a JSON file, got {type(source).__name__}")
    data = dict(source)
    if "config" in data:
        base = data.pop("config")
        if isinstance(base, Mapping):
            merged = dict(base)
        elif isinstance(base, (str, os.PathLike)):
            merged = read_json_config(Path(base), "config")
        else:
            raise DSCompileConfigError("config", "expected a path to a ds_config.json or a dict")
        merged.update(data)  # keys given beside "config" override the file's
        data = merged
    return data


def read_json_config(path: Path, key: str) -> dict[str, Any]:
    """The JSON object in the ds_config file ``path`` (given as config key ``key``), or an error naming the key."""
    if path.is_dir():
        raise DSCompileConfigError(key, f"{str(path)!r} is a directory, not a file", "pass the path of a ds_config.json file in it")
    if not path.is_file():
        raise DSCompileConfigError(key, f"file {str(path)!r} does not exist", "pass the path of a ds_config.json")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DSCompileConfigError(key, f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise DSCompileConfigError(key, f"{path} must hold a JSON object")
    return data


_TOP_LEVEL_ALIASES = {"bfloat16": "bf16"}  # DeepSpeed's older spelling


def _parse_top_level(data: dict[str, Any]) -> DSConfig:
    for old, new in _TOP_LEVEL_ALIASES.items():
        if old in data:
            if new in data:
                raise DSCompileConfigError(old, f"given together with {new!r}", f"keep only {new!r}")
            data = {(new if k == old else k): v for k, v in data.items()}
    own: dict[str, Any] = {}
    sections: dict[str, Any] = {}
    pipeline_parallel = None
    for key, value in data.items():
        if key == "pipeline" and isinstance(value, Mapping):
            pipeline_parallel = value  # DeepSpeed's pipeline-parallel section, not a pass spec
            continue
        if key in _SECTIONS:
            spec = _SECTIONS[key]
            if spec.parser is None:
                if isinstance(value, Mapping):
                    refuse_unfilled_auto(f"{key}.enabled", value.get("enabled"))
                if spec.is_disabled(value):
                    continue
                raise DSCompileNotSupportedError(key, spec.capability)
            sections[key] = spec.parser(value, key)
            continue
        if key in _UNBUILT_FLAGS:
            default, capability = _UNBUILT_FLAGS[key]
            if value != default:
                raise DSCompileNotSupportedError(key, capability)
            continue
        if key not in _OWN_KEYS:
            hint = suggest(key, list(_OWN_KEYS) + list(_SECTIONS) + list(_UNBUILT_FLAGS))
            raise DSCompileConfigError(key, "unknown key", hint or "see README.md for the supported keys")
        own[key] = value
    if pipeline_parallel is not None:
        if "pipeline_parallel" in _SECTIONS and _SECTIONS["pipeline_parallel"].parser is not None:
            parsed = _SECTIONS["pipeline_parallel"].parser(pipeline_parallel, "pipeline")
            if parsed is not None:  # None: "stages": "auto", the stage count of a PipelineModule
                sections["pipeline_parallel"] = parsed
        else:
            raise DSCompileNotSupportedError("pipeline", "pipeline parallelism")
    log_no_effect_keys("optimizer", own.get("optimizer"), {"legacy_fusion": "it picks DeepSpeed's fp16 optimizer implementation; the maths is the same"})
    config = parse_dataclass(DSConfig, own, "")
    config.sections = sections
    config.raw = dict(data)
    if config.gradient_clipping < 0:
        raise DSCompileConfigError("gradient_clipping", f"must be >= 0, got {config.gradient_clipping}")
    if config.steps_per_print <= 0:
        raise DSCompileConfigError("steps_per_print", f"must be positive, got {config.steps_per_print}")
    if config.prescale_gradients and config.gradient_predivide_factor != 1.0:
        raise DSCompileConfigError("gradient_predivide_factor", "cannot be combined with prescale_gradients", "set only one of them")
    if config.gradient_predivide_factor <= 0:
        raise DSCompileConfigError("gradient_predivide_factor", f"must be > 0, got {config.gradient_predivide_factor}")
    _check_compressed_comm_optimizer(config)
    if config.pipeline is not None:
        from dscompile.errors import DSCompilePipelineError
        from dscompile.pipeline import parse_pipeline

        try:
            parse_pipeline(config.pipeline)
        except DSCompilePipelineError as exc:
            raise DSCompileConfigError("pipeline", str(exc)) from None
    return config


_COMPRESSED_COMM_OPTIMIZERS = ("onebitadam", "zerooneadam", "onebitlamb")


ZERO_ONE_ADAM_ZERO_REFUSAL = (
    "ZeroOneAdam cannot step ZeRO shards: after var_freeze_step its local steps move each rank's *own* full parameters "
    "with its own gradient and its own full momentum, so the replicas drift apart until the next synchronisation "
    "(which restarts every rank from the previous one's parameters); ZeRO keeps one copy of the fp32 weights and "
    "momentum split over the ranks, so no rank holds the drifting replica and momentum it would step, and keeping them "
    "per rank would undo ZeRO's memory saving (its variance phase alone would shard, the local steps cannot)",
    "use OneBitAdam or OneBitLamb with zero_optimization.stage 1 or 2 (their reduce-scatter goes 1-bit), or ZeroOneAdam with zero_optimization.stage 0",
)
"""Why 0/1 Adam and ZeRO-1/2 do not compose, and what to use instead (the config check and the runtime raise it)."""


def _check_compressed_comm_optimizer(config: DSConfig) -> None:
    """1-bit optimizers average over every data-parallel rank: refuse the layouts they cannot serve.

    OneBitAdam and OneBitLamb compose with ZeRO stages 1 and 2 (their reduce-scatter goes 1-bit); stage 3
    gathers inside the compiled graphs, and 0/1 Adam's local steps step drifting full replicas that ZeRO's
    partitioned weights and momentum cannot hold, so those are refused here, before anything is built
    (the runtime refuses them again, with the same reasons, for an optimizer object passed in)."""
    if config.optimizer is None or config.optimizer.type.lower().replace("_", "") not in _COMPRESSED_COMM_OPTIMIZERS:
        return
    kind = config.optimizer.type.lower().replace("_", "")
    zero = config.sections.get("zero_optimization")
    stage = getattr(zero, "stage", 0) if zero is not None else 0
    if stage > 0 and kind == "zerooneadam":
        raise DSCompileConfigError(
            "zero_optimization.stage",
            *ZERO_ONE_ADAM_ZERO_REFUSAL,
        )
    if stage > 2:
        raise DSCompileConfigError(
            "zero_optimization.stage",
            f"optimizer {config.optimizer.type} composes with ZeRO stages 1 and 2 only: ZeRO-3 gathers parameters and reduce-scatters "
            "gradients inside the compiled graphs, where the 1-bit exchange (with its per-rank worker errors) is not built",
            "set zero_optimization.stage to 2 or 1 (their reduce-scatter goes 1-bit after the freeze), or 0",
        )
    if "pipeline_parallel" in config.sections:
        raise DSCompileConfigError(
            "pipeline",
            f"optimizer {config.optimizer.type} does not support pipeline parallelism yet (it would average across stages)",
            "train without a pipeline section, or use Adam/AdamW",
        )

