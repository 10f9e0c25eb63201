"""Train the zoo GPT with pipeline parallelism: ``train_gpt.py`` with ``examples/pipeline.json`` as the default config.

    torchrun --nproc-per-node 2 examples/train_gpt_pipeline.py --config examples/pipeline.json
    torchrun --nproc-per-node 4 examples/train_gpt_pipeline.py --steps 10 --save ckpt   # 2 stages x 2 data-parallel

Same flags as ``train_gpt.py``; the pipeline loop lives there (``train_pipeline``), reached
through ``dscompile.initialize`` returning a ``PipelineEngine`` for a config with a
``pipeline`` section.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train_gpt import main  # noqa: E402

if __name__ == "__main__":
    if "--config" not in sys.argv:
        sys.argv[1:1] = ["--config", os.path.join(os.path.dirname(os.path.abspath(__file__)), "pipeline.json")]
    main()
