"""``deepspeed.moe``: importable so scripts load; building a Mixture-of-Experts layer is refused
(``dscompile.moe.layer.MoE``), since expert parallelism is not built yet."""

from dscompile.moe.layer import MoE

__all__ = ["MoE"]
