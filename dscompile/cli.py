"""The ``dscompile`` command: ``dump`` graphs pass by pass, list ``passes``, run the ``demo``, ``compress`` a model, ``plan`` offload, ``generate`` tokens."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import sys
import tempfile
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

FORMATS = ("text", "table", "dot", "svg", "html")


class CLIError(Exception):
    """A user mistake on the command line: printed as one line, exit status 2."""


def load_target(target: str) -> Callable[[], Any]:
    """Resolve ``path/to/file.py:factory`` or ``package.module:factory`` to the factory function."""
    if ":" not in target:
        raise CLIError(f"TARGET {target!r} must be 'path/to/file.py:factory' or 'module:factory'")
    location, _, attr = target.rpartition(":")
    if not attr:
        raise CLIError(f"TARGET {target!r} names no factory after ':'")
    if location.endswith(".py") or "/" in location:
        path = Path(location)
        if not path.is_file():
            raise CLIError(f"TARGET file {location!r} does not exist")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(path.parent.resolve()))
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise CLIError(f"importing {location!r} failed: {type(exc).__name__}: {exc}") from None
        finally:
            sys.path.pop(0)
    else:
        try:
            module = importlib.import_module(location)
        except ImportError as exc:
            raise CLIError(f"cannot import module {location!r}: {exc}") from None
    factory = getattr(module, attr, None)
    if factory is None:
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        raise CLIError(f"{location!r} has no attribute {attr!r}; callables there: {', '.join(names[:12]) or 'none'}")
    if not callable(factory):
        raise CLIError(f"{target!r} is not callable")
    return factory


def _call_factory(factory: Callable[[], Any], target: str) -> tuple[Any, tuple]:
    import torch

    try:
        result = factory()
    except Exception as exc:
        raise CLIError(f"factory {target!r} raised {type(exc).__name__}: {exc}") from None
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.nn.Module)):
        raise CLIError(f"factory {target!r} must return (model, example_inputs), got {type(result).__name__}")
    model, inputs = result
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    return model, tuple(inputs)


def _step_dirs(out: Path, after: str | None) -> list[Path]:
    chosen = []
    for graph_dir in sorted(p for p in out.iterdir() if p.is_dir()):
        # Step directories are NN_pass; others (the Triton lowering's kernels/) are not steps.
        steps = sorted(p for p in graph_dir.iterdir() if p.is_dir() and p.name.split("_", 1)[0].isdigit() and "_" in p.name)
        if after is not None:
            steps = [s for s in steps if s.name.split("_", 1)[1] == after]
        if steps:
            chosen.append(steps[-1])
    return chosen


def cmd_dump(args: argparse.Namespace) -> int:
    import torch

    from dscompile.config import load_config
    from dscompile.dump import print_summaries
    from dscompile.pipeline import get_pass

    factory = load_target(args.target)
    if args.after is not None and args.after != "captured":
        get_pass(args.after)  # fails with a suggestion on a typo
    options: dict[str, Any] = {}
    if args.config:
        options["config"] = args.config
    if args.pipeline:
        options["pipeline"] = args.pipeline
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="dscompile-dump-"))
    out.mkdir(parents=True, exist_ok=True)
    options["dump"] = str(out)
    config = load_config(options)
    if config.lower is None and not config.pipeline:
        config.lower = "eager"  # the graphs are what a dump is for; skip Inductor's compile time
    model, inputs = _call_factory(factory, args.target)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="dscompile", options=config)
    if args.inference:
        with torch.no_grad():
            compiled(*inputs)
    else:
        output = compiled(*inputs)
        loss = output if isinstance(output, torch.Tensor) else next((o for o in output if isinstance(o, torch.Tensor)), None)
        if loss is not None and loss.requires_grad:
            loss.float().sum().backward()
    _write_predicted_communication(model, config, args.world_size, out)
    _write_parallel_plan(config, args.world_size, out)
    steps = _step_dirs(out, args.after)
    if not steps:
        raise CLIError(f"no graph was dumped after pass {args.after!r}; passes that ran: see {out}")
    for step in steps:
        header = f"== {step.parent.name} after {step.name.split('_', 1)[1]} =="
        if args.format == "text":
            print(header)
            print((step / "code.py").read_text())
        elif args.format == "table":
            print(header)
            print((step / "nodes.txt").read_text())
        elif args.format == "dot":
            print((step / "graph.dot").read_text())
        elif args.format == "svg":
            svg = step / "graph.svg"
            if not svg.is_file():
                raise CLIError("SVG needs Graphviz's 'dot' on PATH (apt-get install graphviz); --format dot works without it")
            print(svg)
        regions = step.parent / "regions.txt"  # written by the fuse pass and the Triton lowering
        if args.format in ("text", "table") and regions.is_file():
            print(f"== {step.parent.name}: fusion regions and the nodes left out ==")
            print(regions.read_text())
        lowering = step / "lowering.txt"  # the lowering's own step: the lowering, why, and what runs each node
        if args.format in ("text", "table") and lowering.is_file():
            print(f"== {step.parent.name}: lowering ==")
            print(lowering.read_text())
    if args.format == "html":
        for page in sorted(out.glob("*.html")):
            print(page)
    if args.format in ("text", "table"):
        print(print_summaries(out))
    print(f"dump written to {out}", file=sys.stderr)
    return 0


def _write_predicted_communication(model: Any, config: Any, world_size: int, out: Path) -> None:
    """A 1-bit optimizer in the config: the bytes per step its engine would send on ``world_size`` ranks, planned from
    the same buckets (``communication_predicted.json``, listed by ``print_summaries``)."""
    from dscompile.runtime.onebit.predict import predict_step_bytes

    numels = [p.numel() for p in model.parameters() if p.requires_grad]
    prediction = predict_step_bytes(numels, world_size, config)
    if prediction is not None:
        (out / "communication_predicted.json").write_text(json.dumps(prediction, indent=1))


def _write_parallel_plan(config: Any, world_size: int, out: Path) -> None:
    """``plan.txt``: the parallel plan an engine would decide for this config on ``world_size`` ranks (the engines write
    their own when they run with ``dump``); a layout that cannot hold on that many ranks says why instead."""
    from dscompile.errors import DSCompileError
    from dscompile.planner import PLAN_FILE, plan_parallel, write_plan

    try:
        write_plan(plan_parallel(config, world_size), out)
    except DSCompileError as exc:
        (out / PLAN_FILE).write_text(f"no parallel plan on {world_size} ranks: {exc}\n(pass --world-size N for the ranks the config lays out)\n")


def _describe_type(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " | ".join(str(a) for a in typing.get_args(annotation))
    return getattr(annotation, "__name__", str(annotation)).replace("typing.", "")


def cmd_passes(args: argparse.Namespace) -> int:
    from dscompile.backends import lowerings
    from dscompile.pipeline import registered_passes

    passes = registered_passes()
    if args.json:
        print(
            json.dumps(
                {name: {"graphs": info.graphs, "doc": info.doc, "options": [f.name for f in info.option_fields()]} for name, info in passes.items()}, indent=2
            )
        )
        return 0
    for name, info in passes.items():
        graphs = ", ".join(info.graphs) if info.graphs else "pipeline setting"
        print(f"{name}  [{graphs}]")
        if info.doc:
            print(f"    {info.doc.splitlines()[0]}")
        hints = typing.get_type_hints(info.options) if info.options else {}
        for f in info.option_fields():
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            help_text = f.metadata.get("help", "")
            print(f"    {f.name}: {_describe_type(hints.get(f.name))} = {default!r}" + (f"  {help_text}" if help_text else ""))
        if info.requires:
            print(f"    requires: {', '.join(info.requires)}")
        if info.conflicts:
            print(f"    conflicts: {', '.join(info.conflicts)}")
    print("lowerings: " + ", ".join(sorted(lowerings())))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from dscompile.demo import run_demo

    run_demo(steps=args.steps, lower=args.lower)
    return 0


def cmd_compress(args: argparse.Namespace) -> int:
    from dscompile.compression_report import compress_report

    model, inputs = _call_factory(load_target(args.target), args.target)
    report = compress_report(model, inputs, args.config, save=args.save)
    print(report.render())
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the plan the engine would make for this model and config on ``--world`` ranks, before anything runs: the
    parallel plan (layout, effective ZeRO stage, offload, prefetch, checkpointing) and, with offload, where each
    model state lives."""
    import torch

    from dscompile.config import load_config
    from dscompile.planner import non_shard_device_bytes, plan_optimizer_offload, plan_parallel, plan_param_offload, zero_parameters
    from dscompile.runtime.offload.host import state_bytes_per_element
    from dscompile.runtime.optimizers import build_optimizer

    if args.world < 1:
        raise CLIError(f"--world must be >= 1, got {args.world}")
    model, _ = _call_factory(load_target(args.target), args.target)
    config = load_config(args.config)
    parallel = plan_parallel(config, args.world)
    if parallel.offload_optimizer == "none" and parallel.offload_param == "none":
        print(parallel.text())
        return 0
    zc = config.sections["zero_optimization"]
    dp = parallel.layout.dp_size  # ZeRO partitions over the data-parallel group
    named = [(name, p.numel()) for name, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise CLIError(f"{args.target}: the model has no trainable parameters")
    threshold = zc.stage3_param_persistence_threshold if zc.stage == 3 else 0
    params = zero_parameters(named, zc.stage, dp, threshold, zc.stage3_model_persistence_threshold if zc.stage == 3 else None)
    if config.optimizer is not None:
        probe = torch.nn.Parameter(torch.zeros(1))
        per_element = state_bytes_per_element(build_optimizer(config.optimizer, [probe]))
    else:
        per_element = 8
        print("no optimizer section: planning for Adam's 8 bytes of state per element")
    host_is_device = not torch.cuda.is_available()
    plan = None
    if parallel.offload_optimizer != "none":
        plan = plan_optimizer_offload(
            params,
            stage=zc.stage,
            world=dp,
            device=zc.offload_optimizer.device,
            state_bytes_per_element=per_element,
            ratio=float(zc.offload_optimizer.ratio),
            limit=int(zc.offload_memory_limit),
            host_is_device=host_is_device,
            sub_group_size=zc.sub_group_size,
            buffer_count=zc.offload_optimizer.buffer_count,
        )
    param_plan = None
    if parallel.offload_param != "none":  # the engine's order: the optimizer's plan first, the shards then fill what is left under the limit
        op = zc.offload_param
        other = non_shard_device_bytes(params, 4, plan, per_element)
        param_plan = plan_param_offload(
            params, dp, op.device, 4, op.buffer_count, op.buffer_size, op.max_in_cpu, int(zc.offload_memory_limit), other, host_is_device
        )
    print(parallel.with_placements(optimizer=plan, param=param_plan).text())
    return 0


def _prompt_ids(text: str | None, default: tuple) -> Any:
    """``--prompt "5 17 42"`` (token ids, spaces or commas) as a ``[1, n]`` tensor; the factory's input without it."""
    import torch

    if text is None:
        ids = default[0] if default else None
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise CLIError("give --prompt (token ids) or a factory whose example input is a [batch, length] tensor of token ids")
        return ids
    try:
        tokens = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise CLIError(f"--prompt takes token ids separated by spaces or commas (no tokenizer is loaded), got {text!r}") from None
    if not tokens:
        raise CLIError("--prompt is empty")
    return torch.tensor([tokens], dtype=torch.long)


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate with ``init_inference`` (static KV cache, compiled prefill and decode) and print tokens/s."""
    from dscompile.engines.inference import init_inference

    model, inputs = _call_factory(load_target(args.target), args.target)
    ids = _prompt_ids(args.prompt, inputs)
    if args.max_new_tokens < 1:
        raise CLIError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    config: dict[str, Any] = {
        "dtype": args.dtype,
        "max_out_tokens": args.max_out_tokens or ids.shape[1] + args.max_new_tokens,
        "replace_with_kernel_inject": args.kernel_inject,
    }
    if args.lower:
        config["lower"] = args.lower
    if args.quant_bits:
        config["quant"] = {"enabled": True, "weight": {"num_bits": args.quant_bits, "q_groups": args.q_groups}}
    engine = init_inference(model, config=config)
    out = engine.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, seed=args.seed, return_dict_in_generate=True)
    if args.runs > 1:  # the first run compiles; time the last one
        for _ in range(args.runs - 1):
            out = engine.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, seed=args.seed, return_dict_in_generate=True)
    for row in out.sequences.tolist():
        print(" ".join(str(t) for t in row[ids.shape[1] :]))
    total = out.first_token_s + out.decode_s
    rate = out.new_tokens * ids.shape[0] / total if total > 0 else float("inf")
    note = " (includes compilation: pass --runs 2 to time a compiled run)" if args.runs == 1 else ""
    print(
        f"{out.new_tokens} new tokens x {ids.shape[0]} sequences in {total:.3f} s: {rate:.1f} tokens/s, "
        f"first token {1000 * out.first_token_s:.1f} ms{note}; graphs compiled {engine.compile_counts}"
    )
    return 0


def cmd_zero_to_fp32(args: argparse.Namespace) -> int:
    from dscompile.runtime.checkpoint_formats import main as zero_to_fp32

    return zero_to_fp32(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dscompile", description="DeepSpeed's optimizations as a torch.compile backend")
    sub = parser.add_subparsers(dest="command", required=True)
    dump = sub.add_parser("dump", help="compile a model and show its graphs before and after each pass")
    dump.add_argument("target", metavar="TARGET", help="path/to/file.py:factory or module:factory returning (model, example_inputs)")
    dump.add_argument("--config", help="a ds_config.json")
    dump.add_argument("--pipeline", help="a textual pipeline, e.g. 'cse,dce,lower(eager)'")
    dump.add_argument("--out", help="dump directory (default: a new temporary directory)")
    dump.add_argument("--format", choices=FORMATS, default="text")
    dump.add_argument("--after", metavar="PASS", help="show the graphs after this pass ('captured' for before the first)")
    dump.add_argument("--inference", action="store_true", help="run under torch.no_grad() (forward graph only)")
    dump.add_argument("--world-size", type=int, default=2, help="ranks to plan for: the parallel plan, a 1-bit optimizer's bytes per step (default 2)")
    dump.set_defaults(func=cmd_dump)
    passes = sub.add_parser("passes", help="list the registered passes with their options")
    passes.add_argument("--json", action="store_true")
    passes.set_defaults(func=cmd_passes)
    demo = sub.add_parser("demo", help="train a small GPT with backend='dscompile' next to eager PyTorch")
    demo.add_argument("--steps", type=int, default=5)
    demo.add_argument("--lower", choices=("eager", "inductor", "triton"), default=None)
    demo.set_defaults(func=cmd_demo)
    compress = sub.add_parser("compress", help="compress a model with a compression_training config: sizes before/after, output error")
    compress.add_argument("target", metavar="TARGET", help="path/to/file.py:factory or module:factory returning (model, example_inputs)")
    compress.add_argument("--config", required=True, help="a ds_config.json with a compression_training section")
    compress.add_argument("--save", metavar="FILE", help="write the cleaned model's state_dict here")
    compress.set_defaults(func=cmd_compress)
    plan = sub.add_parser(
        "plan", help="print the parallel plan (layout, ZeRO stage, offload, prefetch, checkpointing) and where each model state would live"
    )
    plan.add_argument("target", metavar="TARGET", help="path/to/file.py:factory or module:factory returning (model, example_inputs)")
    plan.add_argument("--config", required=True, help="a ds_config.json")
    plan.add_argument("--world", type=int, default=1, help="ranks to plan for (the world size; default 1)")
    plan.set_defaults(func=cmd_plan)
    gen = sub.add_parser("generate", help="generate tokens with init_inference (static KV cache, compiled decode) and print tokens/s")
    gen.add_argument("target", metavar="TARGET", help="path/to/file.py:factory or module:factory returning (a Hugging Face causal LM, (input_ids,))")
    gen.add_argument("--prompt", help="prompt token ids separated by spaces or commas (default: the factory's example input_ids)")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--max-out-tokens", type=int, default=None, help="KV cache size (default: prompt + new tokens)")
    gen.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default="fp32")
    gen.add_argument("--quant-bits", type=int, choices=(8, 4), default=None, help="weight-only quantization")
    gen.add_argument("--q-groups", type=int, default=None, help="DeepSpeed's q_groups (default: groups of 128 columns per row)")
    gen.add_argument("--kernel-inject", action="store_true", help="run the inference fusion passes (replace_with_kernel_inject)")
    gen.add_argument("--lower", choices=("eager", "inductor", "triton"), default=None)
    gen.add_argument("--do-sample", action="store_true")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--runs", type=int, default=1, help="generate this many times and time the last (the first compiles)")
    gen.set_defaults(func=cmd_generate)
    z2f = sub.add_parser(
        "zero-to-fp32", help="consolidate a ZeRO checkpoint (dscompile's or DeepSpeed's) into one fp32 state_dict: CKPT OUT [--tag TAG]"
    )
    z2f.add_argument("rest", nargs=argparse.REMAINDER)
    z2f.set_defaults(func=cmd_zero_to_fp32)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from dscompile.errors import DSCompileError

    args = build_parser().parse_args(argv)
    from dscompile.backends.triton.kernel_cache import interpret_without_gpu

    interpret_without_gpu()  # Triton kernels (lower=triton, sparse attention) need it before triton is imported
    try:
        return args.func(args)
    except (CLIError, DSCompileError) as exc:
        print(f"dscompile {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
