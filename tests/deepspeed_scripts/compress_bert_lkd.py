"""The core of DeepSpeedExamples' compression/bert/run_glue_lkd.py (layer-wise knowledge distillation), tiny:

    deepspeed compress_bert_lkd.py --deepspeed --deepspeed_config ds_config.json --out result.json --save model.pt

As the example: ``init_compression(model, config, teacher_model=teacher)``, ``deepspeed.initialize`` with
the script's optimizer, an evaluation, ``model.eval()``; then for each encoder layer a plain AdamW over that
layer's parameters trains the layer of ``model.module``, called alone on the teacher's hidden state, to
the teacher's next hidden state (MSE); the evaluation again. Changes to the example: a BERT built from a
tiny config (no dropout), synthetic batches, CPU, torch's AdamW, and the extended attention mask built by
hand (transformers 5 dropped ``get_extended_attention_mask``).
"""

import argparse
import copy

import deepspeed
import torch
from deepspeed.compression.compress import init_compression
from deepspeed.compression.helper import recursive_getattr
from ds_models import report
from transformers import BertConfig, BertForSequenceClassification

parser = argparse.ArgumentParser(description="compression/bert run_glue_lkd, tiny")
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--learning_rate", type=float, default=1e-2)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--out", type=str, default=None)
parser.add_argument("--save", type=str, default=None)
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()

deepspeed.init_distributed()
torch.manual_seed(0)
config = BertConfig(vocab_size=96, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
                    max_position_embeddings=32, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
config._attn_implementation = "eager"
teacher = BertForSequenceClassification(config).eval()
model = copy.deepcopy(teacher)  # the example loads the same fine-tuned checkpoint as student and teacher
model = init_compression(model, args.deepspeed_config, teacher_model=teacher)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
model, optimizer, _, _ = deepspeed.initialize(args=args, model=model, optimizer=optimizer)

generator = torch.Generator().manual_seed(1)
batches = [
    {"input_ids": torch.randint(0, 96, (4, 16), generator=generator), "attention_mask": torch.ones(4, 16, dtype=torch.long)}
    for _ in range(args.steps)
]
for batch in batches:
    batch["attention_mask"][:, 12:] = 0  # padded tails: the mask matters


def evaluate() -> list[float]:
    with torch.no_grad():
        return torch.cat([model(**batch).logits for batch in batches]).flatten().tolist()


before = evaluate()
model.eval()
losses = []
for layer in range(model.module.config.num_hidden_layers):
    student_layer = recursive_getattr(model.module, f"bert.encoder.layer.{layer}")
    layer_optimizer = torch.optim.AdamW(student_layer.parameters(), lr=args.learning_rate)
    for batch in batches:
        with torch.no_grad():
            teacher_out = teacher(**batch, output_hidden_states=True)
        mask = (1.0 - batch["attention_mask"][:, None, None, :].float()) * torch.finfo(torch.float32).min
        student_out = student_layer(teacher_out.hidden_states[layer], mask)
        student_out = student_out[0] if isinstance(student_out, tuple) else student_out
        loss = torch.nn.functional.mse_loss(student_out, teacher_out.hidden_states[layer + 1])
        layer_optimizer.zero_grad()
        loss.backward()
        layer_optimizer.step()
        losses.append(loss.item())
report(args.out, {"losses": losses, "eval": before, "eval_after": evaluate()})
if args.save:
    torch.save({k: p.detach().clone() for k, p in model.module.named_parameters()}, args.save)  # the trained parameters
