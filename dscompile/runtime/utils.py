"""``deepspeed.runtime.utils``: the names DeepSpeed scripts import from there (re-exported only)."""

from dscompile.runtime.dataloader import RepeatingLoader, set_random_seed
from dscompile.runtime.engine_metrics import see_memory_usage

__all__ = ["RepeatingLoader", "see_memory_usage", "set_random_seed"]
