"""DeepSpeed's ``deepspeed.runtime.zero`` import path (``from deepspeed.runtime.zero.offload_config import ...``)."""
