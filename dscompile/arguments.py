"""``deepspeed.add_config_arguments``: the command-line flags DeepSpeed scripts parse."""

from __future__ import annotations

import argparse

from dscompile.errors import DSCompileConfigError


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's group: ``--deepspeed``, ``--deepspeed_config PATH`` and the deprecated
    ``--deepscale``/``--deepscale_config``. ``dscompile.initialize(args=args)`` reads the config
    path from ``args.deepspeed_config`` (or ``args.deepscale_config``)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true", help="enable DeepSpeed (a flag for the script; dscompile reads nothing from it)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="path of the ds_config.json")
    group.add_argument("--deepscale", default=False, action="store_true", help="deprecated name of --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="deprecated name of --deepspeed_config")
    return parser


def config_source(args: object, config: object) -> object:
    """The config ``initialize`` should load: ``config=`` or the path in ``args``, never both."""
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None) or getattr(args, "ds_config", None)
    if from_args is not None and config is not None:
        raise DSCompileConfigError(
            "config", f"given both as config= and as args.deepspeed_config ({from_args!r})", "pass only one of them, as DeepSpeed requires"
        )
    return config if config is not None else from_args
