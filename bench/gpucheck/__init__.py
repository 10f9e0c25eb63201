"""The sections of ``bench/gpu_check.py``, one module each; ``common`` holds the table, the timers and the fits."""
