"""DeepSpeed's fill-mask inference scripts (inference/huggingface/fill-mask: test-bert.py, test-roberta.py,
test-electra.py) as one program, with only the edits needed to run here:

    torchrun --nproc-per-node 2 fill_mask.py --model DIR [--policy roberta|electra] [--kernel_inject]

Edits against DeepSpeedExamples (the rest is the scripts' code):
- ``--model DIR``: a tiny model saved with ``save_pretrained`` instead of 'bert-large-cased' / 'roberta-large' /
  'google/electra-base-generator' (no downloads); ``--policy`` picks test-roberta.py's or test-electra.py's
  ``injection_policy={RobertaLayer|ElectraLayer: ('output.dense')}`` (a string, as they write it); without it,
  test-bert.py's ``replace_with_kernel_inject=args.kernel_inject``.
- ``pipeline(..., device=-1)``: the host (the scripts pass ``device=local_rank``, a GPU).
- ``--text``: each script's sentence with the tokenizer's mask token, and ``--out``: rank 0 writes the output.
"""

import argparse
import os

import deepspeed
import torch
import transformers  # noqa: F401  (the scripts import it)
from deepspeed.accelerator import get_accelerator
from ds_models import report
from transformers import pipeline
from transformers.models.electra.modeling_electra import ElectraLayer
from transformers.models.roberta.modeling_roberta import RobertaLayer

parser = argparse.ArgumentParser()
parser.add_argument("--model", "-m", type=str, help="hf model name")
parser.add_argument("--dtype", type=str, default="fp16", help="fp16 or fp32 or bf16")
parser.add_argument("--local_rank", type=int, default=0, help="local rank")
parser.add_argument("--trials", type=int, default=8, help="number of trials")
parser.add_argument("--kernel_inject", action="store_true", help="inject kernels on")
parser.add_argument("--graphs", action="store_true", help="CUDA Graphs on")
parser.add_argument("--triton", action="store_true", help="triton kernels on")
parser.add_argument("--deepspeed", action="store_true", help="use deepspeed inference")
parser.add_argument("--task", type=str, default="fill-mask", help="fill-mask or token-classification")
parser.add_argument("--policy", choices=["roberta", "electra"], default=None)
parser.add_argument("--text", type=str, default="In Autumn the {mask} fall from the trees.")
parser.add_argument("--out", type=str, default=None)
args, _ = parser.parse_known_args()  # the harness's --deepspeed_config/--steps are not this script's

local_rank = int(os.getenv("LOCAL_RANK", "0"))
world_size = int(os.getenv("WORLD_SIZE", "4"))

pipe = pipeline("fill-mask", model=args.model, device=-1)

if args.policy is None:
    pipe.model = deepspeed.init_inference(
        pipe.model,
        mp_size=world_size,
        dtype=torch.float16 if args.triton else torch.float,
        replace_with_kernel_inject=args.kernel_inject,
        use_triton=args.triton,
    )
else:
    layer = {"roberta": RobertaLayer, "electra": ElectraLayer}[args.policy]
    pipe.model = deepspeed.init_inference(pipe.model, mp_size=world_size, dtype=torch.float, injection_policy={layer: ("output.dense")})

pipe.device = torch.device(get_accelerator().device_name(local_rank))
output = pipe(args.text.format(mask=pipe.tokenizer.mask_token))

if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
    print(output)
report(args.out, {"output": output})
