"""``deepspeed.module_inject.layers``: AutoTP's training-mode switch.

DeepSpeed instruments its layer replacement for training when a script calls
``set_autotp_mode(training=True)`` before building the model. dscompile finds the tensor-parallel
split in the captured graph at the first batch, so there is nothing to instrument: the switch is
kept (and reported by ``is_autotp_training_mode``) so such scripts run unchanged.
"""

from __future__ import annotations

_training = False


def set_autotp_mode(training: bool = False) -> None:
    """Record whether AutoTP is used for training (dscompile's split does not depend on it)."""
    global _training
    _training = bool(training)


def is_autotp_training_mode() -> bool:
    return _training
