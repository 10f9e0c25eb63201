"""DeepSpeed's ``deepspeed.runtime.zero.partition_parameters`` (``ZeroParamStatus``, ``GatheredParameters``, ``Init``),
where DeepSpeed-Chat and Hugging Face's ZeRO-3 save idiom import them from; re-exported from ``dscompile.zero``."""

from dscompile.zero import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    register_external_parameter,
    unregister_external_parameter,
)

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter", "unregister_external_parameter"]
