"""``deepspeed.runtime.utils``: the names DeepSpeed scripts import from there (re-exported only)."""

from dscompile.runtime.dataloader import RepeatingLoader, set_random_seed

__all__ = ["RepeatingLoader", "set_random_seed"]
