"""Pass protocol, registry, textual pipeline specs and the pass manager.

Modelled on MLIR's pass infrastructure: passes register under a short name with typed
options; a pipeline is a list of invocations that can be written as text
(``cse,dce,lower(eager)``); after every pass the graph is linted (and in debug mode its fake
values are re-propagated and compared), timed, and dumped when a dump directory is set.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import math
import re
import time
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin

import torch.fx

from dscompile.errors import DSCompilePipelineError, suggest

log = logging.getLogger("dscompile.pipeline")

GraphKind = Literal["pre_autograd", "joint", "forward", "backward"]
GRAPH_KINDS: tuple[str, ...] = typing.get_args(GraphKind)

PassFn = Callable[[torch.fx.GraphModule, "PassContext", Any], "torch.fx.GraphModule | None"]


@dataclass
class PassContext:
    """What a pass may know about the graph it rewrites and the run it belongs to.

    ``analysis`` is shared by every graph of one compile (Dynamo graph, joint, forward,
    backward), so a forward pass can leave a decision the backward pass reads.
    """

    config: Any
    graph_kind: str
    graph_name: str
    example_inputs: Sequence[Any] = ()
    rank: int = 0
    world_size: int = 1
    is_inference: bool = False
    param_names: dict[int, str] = field(default_factory=dict)
    num_fwd_outputs: int | None = None
    analysis: dict[str, Any] = field(default_factory=dict)

    def logger(self, pass_name: str) -> logging.Logger:
        return logging.getLogger(f"dscompile.passes.{pass_name}")


@dataclass(frozen=True)
class PassInfo:
    """A registered pass: its function, the graphs it runs on, options and ordering facts."""

    name: str
    fn: PassFn | None
    graphs: tuple[str, ...]
    options: type | None
    provides: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()
    conflicts: tuple[str, ...] = ()
    doc: str = ""

    def option_fields(self) -> list[dataclasses.Field]:
        return list(dataclasses.fields(self.options)) if self.options else []


_REGISTRY: dict[str, PassInfo] = {}


def register_pass(
    name: str,
    *,
    graphs: Sequence[str],
    options: type | None = None,
    provides: Sequence[str] = (),
    requires: Sequence[str] = (),
    conflicts: Sequence[str] = (),
) -> Callable[[PassFn], PassFn]:
    """Register ``fn(gm, ctx, options) -> gm | None`` as pass ``name``.

    ``options`` is a dataclass whose fields are the pass's typed options (defaults required);
    ``provides``/``requires``/``conflicts`` name capabilities (usually pass names) the
    pipeline checks before running anything.
    """
    for kind in graphs:
        if kind not in GRAPH_KINDS:
            raise ValueError(f"pass {name!r}: unknown graph kind {kind!r}; use one of {GRAPH_KINDS}")
    if options is not None and not dataclasses.is_dataclass(options):
        raise TypeError(f"pass {name!r}: options must be a dataclass type")

    def decorator(fn: PassFn) -> PassFn:
        if name in _REGISTRY and _REGISTRY[name].fn is not fn:
            raise ValueError(f"pass {name!r} is registered twice")
        _REGISTRY[name] = PassInfo(
            name=name,
            fn=fn,
            graphs=tuple(graphs),
            options=options,
            provides=tuple(provides) or (name,),
            requires=tuple(requires),
            conflicts=tuple(conflicts),
            doc=(fn.__doc__ or "").strip(),
        )
        return fn

    return decorator


def registered_passes() -> dict[str, PassInfo]:
    _ensure_builtin_passes()
    return dict(sorted(_REGISTRY.items()))


def get_pass(name: str) -> PassInfo:
    _ensure_builtin_passes()
    if name not in _REGISTRY:
        hint = suggest(name, _REGISTRY)
        raise DSCompilePipelineError(f"unknown pass '{name}'" + (f"; {hint}" if hint else "") + "; `dscompile passes` lists them")
    return _REGISTRY[name]


# The modules whose import registers the built-in passes, lowerings and config sections. Loaded by name: the
# registry sits below them (DESIGN.md, "Imports point down the layers"), so it never imports them itself.
BUILTIN_MODULES = ("dscompile.deepspeed_config", "dscompile.backends", "dscompile.passes")


def _ensure_builtin_passes() -> None:
    for module in BUILTIN_MODULES:
        importlib.import_module(module)


# -- lowerings ---------------------------------------------------------------------------------------------
LowerFn = Callable[[torch.fx.GraphModule, Sequence[Any], Any], Callable[..., Any]]
PrepareFn = Callable[[torch.fx.GraphModule, Sequence[Any]], torch.fx.GraphModule]


@dataclass(frozen=True)
class Lowering:
    """A lowering: ``compile(gm, example_inputs, ctx)``, the decompositions it wants AOTAutograd to
    apply, what it must do to the joint graph before partitioning (None: nothing), and the registered passes
    whose output it compiles (the frontend runs them on a graph whose pipeline left them out)."""

    name: str
    compile: LowerFn
    decompositions: Callable[[], dict | None]
    doc: str
    prepare_joint: PrepareFn | None = None
    required_passes: tuple[str, ...] = ()


_LOWERINGS: dict[str, Lowering] = {}


def register_lowering(
    name: str,
    *,
    decompositions: Callable[[], dict | None] = lambda: None,
    prepare_joint: PrepareFn | None = None,
    required_passes: tuple[str, ...] = (),
) -> Callable[[LowerFn], LowerFn]:
    """Register ``fn(gm, example_inputs, ctx)`` as the lowering ``name`` (a module in ``backends/``).
    ``required_passes``: passes by name that must have run on a graph before it compiles it (a backend never
    imports a pass: the frontend runs them through this registry)."""

    def decorator(fn: LowerFn) -> LowerFn:
        _LOWERINGS[name] = Lowering(name, fn, decompositions, (fn.__doc__ or "").strip(), prepare_joint, required_passes)
        return fn

    return decorator


def get_lowering(name: str) -> Lowering:
    from dscompile.errors import DSCompileConfigError

    _ensure_builtin_passes()
    if name not in _LOWERINGS:
        raise DSCompileConfigError("lower", f"unknown lowering {name!r}", suggest(name, _LOWERINGS) or f"use one of {sorted(_LOWERINGS)}")
    return _LOWERINGS[name]


def lowerings() -> dict[str, Lowering]:
    _ensure_builtin_passes()
    return dict(_LOWERINGS)


@dataclass
class PassInvocation:
    """One pass with its options, as it appears in a pipeline."""

    info: PassInfo
    options: Any

    @property
    def name(self) -> str:
        return self.info.name

    def spec(self) -> str:
        if self.options is None:
            return self.name
        parts = []
        for f in dataclasses.fields(self.options):
            value = getattr(self.options, f.name)
            default = f.default if f.default is not dataclasses.MISSING else None
            if value != default:
                parts.append(f"{f.name}={_format_value(value)}")
        if len(parts) == 1 and len(dataclasses.fields(self.options)) == 1:
            parts = [parts[0].split("=", 1)[1]]  # single-option passes read best positionally: lower(eager)
        return f"{self.name}({','.join(parts)})" if parts else self.name


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ";".join(_format_value(v) for v in value) + "]"
    return str(value)


def invocation(name: str, *positional: Any, **keywords: Any) -> PassInvocation:
    """Build an invocation from Python values (used by the config → pipeline mapping)."""
    info = get_pass(name)
    return PassInvocation(info, _make_options(info, list(positional), keywords, source=name))


_ITEM = re.compile(r"\s*([A-Za-z_][\w.]*)\s*(?:\((.*?)\))?\s*$", re.S)


def _split_top_level(text: str, sep: str = ",") -> list[str]:
    parts, depth, current = [], 0, []
    for ch in text:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
            if depth < 0:
                raise DSCompilePipelineError(f"unbalanced ')' in pipeline {text!r}")
        if ch == sep and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth != 0:
        raise DSCompilePipelineError(f"unbalanced '(' in pipeline {text!r}")
    parts.append("".join(current))
    return parts


def parse_pipeline(spec: str) -> list[PassInvocation]:
    """Parse ``name(opt=value,...)`` items separated by commas into invocations.

    Values are ints, floats, ``true``/``false``, ``none``, bare or quoted strings, and lists
    written ``[a;b;c]``. A positional value fills the pass's options in declaration order.
    """
    invocations: list[PassInvocation] = []
    for raw in _split_top_level(spec):
        if not raw.strip():
            continue
        m = _ITEM.match(raw)
        if not m:
            raise DSCompilePipelineError(f"cannot parse pipeline item {raw.strip()!r}; expected name or name(key=value,...)")
        name, arg_text = m.group(1), m.group(2)
        info = get_pass(name)
        positional: list[Any] = []
        keywords: dict[str, Any] = {}
        if arg_text and arg_text.strip():
            for arg in _split_top_level(arg_text):
                if "=" in arg:
                    key, value = arg.split("=", 1)
                    keywords[key.strip()] = _parse_value(value.strip())
                elif arg.strip():
                    positional.append(_parse_value(arg.strip()))
        invocations.append(PassInvocation(info, _make_options(info, positional, keywords, source=raw.strip())))
    return invocations


def _parse_value(text: str) -> Any:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    if text.startswith("[") and text.endswith("]"):
        inner = text[1:-1].strip()
        return [_parse_value(v.strip()) for v in _split_top_level(inner, ";")] if inner else []
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _make_options(info: PassInfo, positional: list[Any], keywords: dict[str, Any], source: str) -> Any:
    fields = info.option_fields()
    if not fields:
        if positional or keywords:
            raise DSCompilePipelineError(f"pass '{info.name}' takes no options (in {source!r})")
        return None
    if len(positional) > len(fields):
        raise DSCompilePipelineError(f"pass '{info.name}' takes at most {len(fields)} positional options (in {source!r})")
    names = [f.name for f in fields]
    values: dict[str, Any] = dict(zip(names, positional))
    for key, value in keywords.items():
        if key not in names:
            hint = suggest(key, names)
            raise DSCompilePipelineError(f"pass '{info.name}' has no option '{key}'" + (f"; {hint}" if hint else "") + f"; options: {', '.join(names)}")
        if key in values:
            raise DSCompilePipelineError(f"pass '{info.name}': option '{key}' given twice (in {source!r})")
        values[key] = value
    hints = typing.get_type_hints(info.options)
    coerced = {k: coerce_value(v, hints[k], f"{info.name}.{k}") for k, v in values.items()}
    try:
        return info.options(**coerced)
    except DSCompilePipelineError:
        raise
    except (TypeError, ValueError) as exc:
        raise DSCompilePipelineError(f"pass '{info.name}': {exc}") from None


def coerce_value(value: Any, annotation: Any, where: str) -> Any:
    """Check ``value`` against a type annotation, converting where it is lossless (int → float)."""
    origin = get_origin(annotation)
    args = get_args(annotation)
    if annotation is Any:
        return value
    if origin is Literal:
        if value not in args:
            hint = suggest(str(value), [str(a) for a in args])
            raise DSCompilePipelineError(f"{where}: {value!r} is not one of {', '.join(map(repr, args))}" + (f"; {hint}" if hint else ""))
        return value
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce_value(value, arg, where)
            except DSCompilePipelineError as exc:
                errors.append(str(exc))
        raise DSCompilePipelineError(errors[0] if errors else f"{where}: bad value {value!r}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            value = [value]
        inner = args[0] if args else Any
        items = [coerce_value(v, inner, where) for v in value]
        return tuple(items) if origin is tuple else items
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise DSCompilePipelineError(f"{where}: expected true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise DSCompilePipelineError(f"{where}: expected an integer, got {value!r}")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise DSCompilePipelineError(f"{where}: must be a finite number, got {value!r}")
            return float(value)
        raise DSCompilePipelineError(f"{where}: expected a number, got {value!r}")
    if annotation is str:
        if isinstance(value, str):
            return value
        return str(value)
    return value


def check_order(invocations: Sequence[PassInvocation]) -> None:
    """Fail before running anything if a pass's requirement is missing or two passes clash."""
    provided: set[str] = set()
    names = [inv.name for inv in invocations]
    for inv in invocations:
        for req in inv.info.requires:
            if req not in provided:
                where = "later in the pipeline" if any(req in other.info.provides for other in invocations) else "nowhere"
                raise DSCompilePipelineError(f"pass '{inv.name}' requires '{req}', which is provided {where}; put a pass providing '{req}' before '{inv.name}'")
        for clash in inv.info.conflicts:
            if clash in names and clash != inv.name:
                raise DSCompilePipelineError(f"pass '{inv.name}' conflicts with '{clash}'; remove one of them")
        provided.update(inv.info.provides)


@dataclass
class PassRecord:
    """What one pass did to one graph: its time and node counts, for the summary and the dump."""

    graph_name: str
    pass_spec: str
    seconds: float
    nodes_before: int
    nodes_after: int


class PassManager:
    """Runs the invocations that apply to a graph kind, verifying and dumping after each."""

    def __init__(
        self,
        invocations: Sequence[PassInvocation],
        *,
        debug: bool = False,
        dumper: Any = None,
    ) -> None:
        check_order(invocations)
        self.invocations = [inv for inv in invocations if inv.info.fn is not None]
        self.debug = debug
        self.dumper = dumper
        self.records: list[PassRecord] = []

    def applicable(self, graph_kind: str) -> list[PassInvocation]:
        return [inv for inv in self.invocations if graph_kind in inv.info.graphs]

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
        from dscompile.graph import lint_graph, verify_fake_values

        if self.dumper is not None:
            self.dumper.dump(gm, ctx, "captured", step=0)
        for step, inv in enumerate(self.applicable(ctx.graph_kind), start=1):
            before = len(gm.graph.nodes)
            start = time.perf_counter()
            result = inv.info.fn(gm, ctx, inv.options)
            if result is not None:
                gm = result
            lint_graph(gm, inv.name)
            gm.recompile()
            if self.debug:
                verify_fake_values(gm, inv.name)
            seconds = time.perf_counter() - start
            record = PassRecord(ctx.graph_name, inv.spec(), seconds, before, len(gm.graph.nodes))
            self.records.append(record)
            log.debug("%s: %s took %.4fs (%d -> %d nodes)", ctx.graph_name, inv.spec(), seconds, before, record.nodes_after)
            if self.dumper is not None:
                self.dumper.dump(gm, ctx, inv.name, step=step, record=record)
        return gm


def register_marker(name: str, *, options: type | None, doc: str) -> None:
    """Register a pipeline item that configures the compile instead of rewriting a graph (``lower``)."""
    _REGISTRY[name] = PassInfo(name=name, fn=None, graphs=(), options=options, provides=(name,), doc=doc)


@dataclass
class LowerOptions:
    backend: str = field(default="auto", metadata={"help": "eager | inductor | triton | auto (inductor, on a GPU as on a CPU)"})

    def __post_init__(self) -> None:
        known = ["auto", *sorted(lowerings())]
        if self.backend not in known:
            hint = suggest(self.backend, known)
            raise DSCompilePipelineError(f"lower: unknown backend {self.backend!r}" + (f"; {hint}" if hint else "") + f"; use one of {known}")


register_marker(
    "lower",
    options=LowerOptions,
    doc="Choose the lowering backend that turns the final forward/backward graphs into callables.",
)


def pipeline_lowering(invocations: Sequence[PassInvocation]) -> str | None:
    """The backend named by the pipeline's ``lower(...)`` item, if any (the last one wins)."""
    chosen = None
    for inv in invocations:
        if inv.name == "lower":
            chosen = inv.options.backend
    return chosen


ConfigRule = Callable[[Any], list[PassInvocation]]
_CONFIG_RULES: list[tuple[int, str, ConfigRule]] = []


def register_config_rule(order: int, name: str) -> Callable[[ConfigRule], ConfigRule]:
    """Register how a config maps to pipeline items.

    ``fn(config) -> [PassInvocation, ...]`` (empty when its capability is off); rules run in
    ``order``: 10 graph rewrites on the Dynamo graph (sparse attention), 20 sharding (ZeRO),
    40 mixed precision, 80 clean-up, 85 checkpointing (it plans on the cleaned joint graph the
    partitioner gets), 90 fusion, then the lowering.
    """

    def decorator(fn: ConfigRule) -> ConfigRule:
        _CONFIG_RULES[:] = [r for r in _CONFIG_RULES if r[1] != name]
        _CONFIG_RULES.append((order, name, fn))
        _CONFIG_RULES.sort(key=lambda r: (r[0], r[1]))
        return fn

    return decorator


def pipeline_from_config(config: Any) -> list[PassInvocation]:
    """The pipeline a config asks for: its textual ``pipeline`` if given, else the rules' output.

    A pipeline without a ``lower(...)`` item gets the config's ``lower`` (or ``auto``) appended.
    """
    _ensure_builtin_passes()
    if config.pipeline:
        invocations = parse_pipeline(config.pipeline)
    else:
        invocations = []
        for _order, _name, rule in _CONFIG_RULES:
            invocations.extend(rule(config))
    if pipeline_lowering(invocations) is None:
        invocations.append(invocation("lower", config.lower or "auto"))
    check_order(invocations)
    return invocations


@register_config_rule(80, "cleanup")
def _cleanup_rule(config: Any) -> list[PassInvocation]:
    return [invocation("cse"), invocation("noop_views"), invocation("dce")]
