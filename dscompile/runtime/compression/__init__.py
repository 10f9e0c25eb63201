"""What compression runs outside graphs: per-layer state, the schedule, the quantized layers."""

from dscompile.runtime.compression.quantized import QuantizedConv2d, QuantizedEmbedding, QuantizedLinear, QuantizedTiedLinear, packed_bytes
from dscompile.runtime.compression.scheduler import CompressionScheduler
from dscompile.runtime.compression.state import ActQuantSpec, CompressionState, MaskSpec, WeightQuantSpec, state_of

__all__ = [
    "ActQuantSpec",
    "CompressionScheduler",
    "CompressionState",
    "MaskSpec",
    "QuantizedConv2d",
    "QuantizedEmbedding",
    "QuantizedLinear",
    "QuantizedTiedLinear",
    "WeightQuantSpec",
    "packed_bytes",
    "state_of",
]
