"""Greedy text generation in the idiom of DeepSpeed's inference-test.py (inference/huggingface/text-generation).

    torchrun --nproc-per-node 2 text_generation.py --model DIR

A Hugging Face causal LM and its tokenizer from ``DIR`` (``from_pretrained``), ``deepspeed.init_inference(model,
dtype=..., mp_size=world_size, replace_with_kernel_inject=False, max_tokens=...)`` under torchrun (the engine
sets up torch.distributed itself), ``see_memory_usage``, then ``model.generate(**tokens)`` on the engine and
the texts decoded. Rank 0 reports the texts and the model config's class as read from ``engine.config``.
"""

import argparse
import os

import deepspeed
import torch
from deepspeed.runtime.utils import see_memory_usage
from ds_models import report
from transformers import AutoModelForCausalLM, AutoTokenizer

parser = argparse.ArgumentParser(description="text generation")
parser.add_argument("--model", required=True)
parser.add_argument("--max_new_tokens", type=int, default=10)
parser.add_argument("--out", type=str, default=None)
parser.add_argument("--local_rank", type=int, default=int(os.getenv("LOCAL_RANK", "0")))
parser.add_argument("--world_size", type=int, default=int(os.getenv("WORLD_SIZE", "1")))
parser.add_argument("--mp_size", type=int, default=None, help="ranks per model (default: the world size)")
args, _ = parser.parse_known_args()  # the harness's --deepspeed_config/--steps are not this script's

tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
tokenizer.pad_token = tokenizer.eos_token
model = AutoModelForCausalLM.from_pretrained(args.model).eval()
see_memory_usage("before init_inference", True)
engine = deepspeed.init_inference(model, dtype=torch.float32, mp_size=args.mp_size or args.world_size, replace_with_kernel_inject=False, max_tokens=64)
see_memory_usage("after init_inference", True)

prompts = ["deepspeed is a machine learning framework", "he is working on", "peace is the only way"]
tokens = tokenizer(prompts, return_tensors="pt", padding=True)
outputs = engine.generate(**tokens, max_new_tokens=args.max_new_tokens, do_sample=False)
texts = tokenizer.batch_decode(outputs, skip_special_tokens=True)
if args.local_rank == 0:
    for prompt, text in zip(prompts, texts):
        print(f"in={prompt}\nout={text}", flush=True)
report(args.out, {"texts": texts, "model_config": type(engine.config).__name__})
