"""DeepSpeed's T5 inference scripts (inference/huggingface/text2text-generation/test-t5.py and
inference/huggingface/translation/test-t5-base.py) as one program, with only the edits needed to run here:

    torchrun --nproc-per-node 1 t5_generation.py --model DIR [--task translation]

Edits against DeepSpeedExamples (the rest is the scripts' code):
- ``--model DIR``: a tiny T5 saved with ``save_pretrained`` instead of 'google/t5-v1_1-small' / 't5-base' (no downloads).
- transformers 5 removed the "text2text-generation" and "translation_en_to_fr" pipelines the scripts build, so the
  pipeline's own steps are written out: the tokenizer, ``generate`` on the engine (``pipe.model`` in the scripts, whose
  pipeline calls ``pipe.model.generate``), the decode; translation's task prefix as its pipeline added it. Greedy, 8 tokens.
- No ``pipe.device = cuda:local_rank``: the host. ``--out``: rank 0 writes the texts and token ids.
"""

import argparse
import os

import deepspeed
import torch
from ds_models import report
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
from transformers.models.t5.modeling_t5 import T5Block

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--task", choices=["text2text", "translation"], default="text2text")
parser.add_argument("--out", type=str, default=None)
args, _ = parser.parse_known_args()  # the harness's --deepspeed_config/--steps are not this script's

local_rank = int(os.getenv("LOCAL_RANK", "0"))
world_size = int(os.getenv("WORLD_SIZE", "4"))

tokenizer = AutoTokenizer.from_pretrained(args.model)
model = AutoModelForSeq2SeqLM.from_pretrained(args.model)

# The injection_policy shows two things:
#   1. which layer module we need to add Tensor-Parallelism
#   2. the name of several linear layers: a) attention_output (both encoder and decoder),
#       and b) transformer output

model = deepspeed.init_inference(
    model, mp_size=world_size, dtype=torch.float, injection_policy={T5Block: ("SelfAttention.o", "EncDecAttention.o", "DenseReluDense.wo")}
)

if args.task == "text2text":
    text = "Is this review positive or negative? Review: this is the best cast iron skillet you will ever buy"
else:
    text = "translate English to French: " + "The quick brown fox jumps over the lazy dog."
inputs = tokenizer(text, return_tensors="pt")
ids = model.generate(**inputs, max_new_tokens=8, do_sample=False)
output = [{"generated_text": t} for t in tokenizer.batch_decode(ids, skip_special_tokens=True)]

if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
    print(output)
report(args.out, {"output": output, "ids": ids.tolist()})
