"""The engines a user's program drives, all on one core (``dscompile.runtime.engine_core``).

``training.DSCompileEngine`` (``dscompile.initialize``), ``pipeline_parallel.PipelineEngine`` (a ``pipeline``
section or a ``PipelineModule``) and ``inference.InferenceEngine`` (``dscompile.init_inference``). They sit on
top of the layers (DESIGN.md): they may import runtime, passes and backends; nothing below imports them.
"""
