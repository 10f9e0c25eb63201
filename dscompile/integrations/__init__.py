"""dscompile inside other libraries' training loops (Hugging Face's Trainer: ``dscompile.integrations.huggingface``).

Entry points, the top layer: they import anything in dscompile, and their library only where they are imported,
so that ``pip install dscompile`` needs none of them (each names the extra that brings its library).
"""
