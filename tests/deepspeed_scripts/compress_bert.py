"""The core of DeepSpeedExamples' compression/bert/run_glue_no_trainer.py (with its util.py), on a tiny BERT:

    deepspeed compress_bert.py --deepspeed --deepspeed_config ds_config.json --distill_method one_stage --out result.json

As the example: the student (fewer layers under layer reduction) and the teacher start from the same
"pretrained" weights, ``init_compression(model, config, teacher_model=teacher)``, ``deepspeed.initialize``
with the script's AdamW, linear scheduler and the config's clipping, the teacher wrapped by its own engine;
each step the engine computes the loss (one_stage: soft cross entropy on the teacher's logits plus MSE on
attentions and hidden states), ``model.backward``, ``model.step``, ``optimizer.zero_grad``; then the
evaluation, ``redundancy_clean`` on the engine and the example's own head-count fix after head pruning,
and the evaluation again. Changes to the example: a BERT built from a tiny config (eager attention, so
that attentions come out; no dropout, whose masks under Inductor are not eager PyTorch's), synthetic
GLUE-like batches, CPU, and torch's AdamW (transformers 5 has no AdamW).
"""

import argparse
import copy
import json
import math
import os
import random

import deepspeed
import numpy as np
import torch
from deepspeed.compression.compress import init_compression, redundancy_clean
from ds_models import report
from torch.nn import MSELoss
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler
from transformers import BertConfig, BertForSequenceClassification, default_data_collator, get_scheduler

parser = argparse.ArgumentParser(description="compression/bert, tiny")
parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", -1)))
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--distill_method", type=str, default="one_stage", choices=["zero_stage", "one_stage"])
parser.add_argument("--learning_rate", type=float, default=1e-3)
parser.add_argument("--weight_decay", type=float, default=0.0)
parser.add_argument("--per_device_train_batch_size", type=int, default=8)
parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
parser.add_argument("--num_warmup_steps", type=int, default=1)
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--teacher_layers", type=int, default=2)
parser.add_argument("--out", type=str, default=None)
parser.add_argument("--save", type=str, default=None)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()

NUM_LABELS, VOCAB, SEQ = 3, 128, 16


def check_and_identify_compression(args, ds_config):
    """util.py's check: which kinds of compression the config turns on."""
    assert args.per_device_train_batch_size == ds_config["train_micro_batch_size_per_gpu"]
    assert args.gradient_accumulation_steps == ds_config["train_batch_size"] / ds_config["train_micro_batch_size_per_gpu"]
    section = ds_config["compression_training"]
    layer_reduction = section["layer_reduction"]["enabled"]
    prune = any(section[k]["shared_parameters"]["enabled"] for k in ("sparse_pruning", "row_pruning", "head_pruning"))
    quantize = any(section[k]["shared_parameters"]["enabled"] for k in ("weight_quantization", "activation_quantization"))
    return layer_reduction, prune, quantize


def glue_like(samples, seed):
    """Tokenized sentence pairs padded to SEQ (``--pad_to_max_length``), three labels as MNLI."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(samples):
        length = int(torch.randint(6, SEQ + 1, (1,), generator=g))
        ids = torch.zeros(SEQ, dtype=torch.long)
        ids[:length] = torch.randint(1, VOCAB, (length,), generator=g)
        mask = (ids != 0).long()
        types = torch.zeros(SEQ, dtype=torch.long)
        types[length // 2 : length] = 1
        rows.append({"input_ids": ids, "attention_mask": mask, "token_type_ids": types, "labels": int(torch.randint(0, NUM_LABELS, (1,), generator=g))})
    return rows


def soft_cross_entropy(predicts, targets):
    student_likelihood = torch.nn.functional.log_softmax(predicts, dim=-1)
    targets_prob = torch.nn.functional.softmax(targets, dim=-1)
    return (-targets_prob * student_likelihood).mean()


def forward_loss(args, ds_config):
    """util.py's forward_loss: the task loss alone, or the one-stage knowledge distillation."""
    if args.distill_method == "zero_stage":
        return lambda batch, model, teacher_model=None: [model(**batch).loss, 0, 0, 0]
    loss_mse = MSELoss()

    def _kd_function(batch, model, teacher_model):
        att_loss, rep_loss, loss = 0.0, 0.0, 0.0
        outputs = model(**batch, output_attentions=True, output_hidden_states=True)
        student_logits, student_reps, student_atts = outputs.logits, outputs.hidden_states, outputs.attentions
        with torch.no_grad():
            outputs_teacher = teacher_model(**batch, output_attentions=True, output_hidden_states=True)
        teacher_logits, teacher_reps, teacher_atts = outputs_teacher.logits, outputs_teacher.hidden_states, outputs_teacher.attentions
        cls_loss = soft_cross_entropy(student_logits, teacher_logits)
        loss += cls_loss
        teacher_layer_num, student_layer_num = len(teacher_atts), len(student_atts)
        if args.layer_reduction_enabled:
            teacher_layers = list(ds_config["compression_training"]["layer_reduction"]["teacher_layer"])
            att_list = list(teacher_layers)
            rep_list = [teacher_layers[0] - 1] + [x + 1 for x in teacher_layers]
        else:
            layers_per_block = int(teacher_layer_num / student_layer_num)
            att_list = [i * layers_per_block + layers_per_block - 1 for i in range(student_layer_num)]
            rep_list = [i * layers_per_block for i in range(student_layer_num + 1)]
        for student_att, teacher_att in zip(student_atts, [teacher_atts[i] for i in att_list]):
            att_loss += loss_mse(student_att, teacher_att)
        for student_rep, teacher_rep in zip(student_reps, [teacher_reps[i] for i in rep_list]):
            rep_loss += loss_mse(student_rep, teacher_rep)
        loss += att_loss + rep_loss
        return [loss, rep_loss.item(), cls_loss.item(), att_loss.item()]

    return _kd_function


def do_eval(model, eval_dataloader):
    """util.py's do_eval, keeping the logits (the example computes the GLUE metric from them)."""
    model.eval()
    logits = []
    for batch in eval_dataloader:
        with torch.no_grad():
            logits.append(model(**batch).logits)
    return torch.cat(logits)


with open(args.deepspeed_config) as f:
    ds_config = json.load(f)
layer_reduction_enabled, prune_enabled, quantization_enabled = check_and_identify_compression(args, ds_config)
args.layer_reduction_enabled = layer_reduction_enabled
deepspeed.init_distributed()
random.seed(args.seed)
np.random.seed(args.seed)
torch.manual_seed(args.seed)

# the pretrained checkpoint both models load (the example: from_pretrained of the same name)
config = BertConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=args.teacher_layers, num_attention_heads=4,
                    intermediate_size=512, max_position_embeddings=32, num_labels=NUM_LABELS, attn_implementation="eager",
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
pretrained = BertForSequenceClassification(config).state_dict()
teacher_config = copy.deepcopy(config)
if layer_reduction_enabled:
    config.num_hidden_layers = ds_config["compression_training"]["layer_reduction"]["keep_number_layer"]
model = BertForSequenceClassification(config)
model.load_state_dict(pretrained, strict=False)
teacher_model = None
if args.distill_method != "zero_stage":
    teacher_model = BertForSequenceClassification(teacher_config)
    teacher_model.load_state_dict(pretrained)
if quantization_enabled or prune_enabled or layer_reduction_enabled:
    model = init_compression(model, args.deepspeed_config, teacher_model=teacher_model)

train_dataset, eval_dataset = glue_like(64, seed=1), glue_like(16, seed=2)
train_sampler = RandomSampler(train_dataset) if args.local_rank == -1 else DistributedSampler(train_dataset)
train_dataloader = DataLoader(train_dataset, collate_fn=default_data_collator, sampler=train_sampler, batch_size=args.per_device_train_batch_size)
eval_dataloader = DataLoader(eval_dataset, collate_fn=default_data_collator, sampler=SequentialSampler(eval_dataset), batch_size=8)

no_decay = ["bias", "LayerNorm.weight"]
optimizer_grouped_parameters = [
    {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": args.weight_decay},
    {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
]
optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)
lr_scheduler = get_scheduler(name="linear", optimizer=optimizer, num_warmup_steps=args.num_warmup_steps, num_training_steps=args.steps)
model, optimizer, _, lr_scheduler = deepspeed.initialize(args=args, model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, dist_init_required=True)
if teacher_model is not None:
    teacher_model, _, _, _ = deepspeed.initialize(args=args, model=teacher_model)
    teacher_model.eval()

forward_fun = forward_loss(args, ds_config)
losses = []
model.train()
for step, batch in enumerate(train_dataloader):
    if step == args.steps:
        break
    all_loss = forward_fun(batch, model, teacher_model=teacher_model)
    model.backward(all_loss[0])
    model.step()
    optimizer.zero_grad()
    losses.append(all_loss[0].item())
    print(f"step {step} loss {losses[-1]:.6f}", flush=True)

before = do_eval(model, eval_dataloader)
model = redundancy_clean(model, args.deepspeed_config)
if ds_config["compression_training"]["head_pruning"]["shared_parameters"]["enabled"]:  # the example's own fix (util.py)
    for module in model.modules():
        if hasattr(module, "num_attention_heads"):
            ratio = ds_config["compression_training"]["head_pruning"]["different_groups"]["rp1"]["params"]["dense_ratio"]
            config.num_attention_heads = math.ceil(config.num_attention_heads * ratio)
            module.num_attention_heads = math.ceil(module.num_attention_heads * ratio)
            module.all_head_size = int(module.num_attention_heads * 64)
after = do_eval(model, eval_dataloader)
cleaned = model.module if hasattr(model, "module") else model
heads = {n: [m.num_attention_heads, m.all_head_size] for n, m in cleaned.named_modules() if hasattr(m, "num_attention_heads")}
if args.save:
    torch.save(cleaned.state_dict(), args.save)
report(args.out, {"losses": losses, "eval": before.tolist(), "eval_clean": after.tolist(), "heads": heads,
                  "shapes": {n: list(p.shape) for n, p in cleaned.named_parameters()},
                  "params": sum(p.numel() for p in cleaned.parameters())})  # fmt: skip
