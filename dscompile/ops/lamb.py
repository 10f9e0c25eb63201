"""``deepspeed.ops.lamb``: importable, so a script that only names ``FusedLamb`` runs; using it is refused."""

from dscompile.deepspeed_paths import refused_name


def __getattr__(name: str) -> object:
    raise refused_name(__name__, name)
