"""What runs outside the graphs at inference: the config of ``init_inference``, the static KV cache
generation loop and the weight-only quantized model conversion."""
