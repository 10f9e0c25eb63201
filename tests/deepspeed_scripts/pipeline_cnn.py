"""Pipeline-parallel image classification in the idiom of DeepSpeed's pipeline tutorial:
a PipelineModule of LayerSpecs, modules and functions, trained with engine.train_batch().

``--engine-loader`` lets the engine draw the micro-batches from ``training_data`` (``train_batch()``
with no iterator), as the tutorial does; without it the script passes ``data_iter``.
"""

import argparse

import deepspeed
import torch
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.utils import RepeatingLoader
from ds_models import image_dataset, pipeline_layers, report

parser = argparse.ArgumentParser(description="pipeline CNN")
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--stages", type=int, default=2)
parser.add_argument("--out", type=str, default=None)
parser.add_argument("--engine-loader", action="store_true")
parser = deepspeed.add_config_arguments(parser)
args = parser.parse_args()

deepspeed.init_distributed(dist_backend="gloo")
deepspeed.runtime.utils.set_random_seed(1138)  # as DeepSpeed's pipeline example: reached as an attribute, not imported
layers = []
for kind, *spec in pipeline_layers():
    layers.append(LayerSpec(spec[0], *spec[1], **spec[2]) if kind == "spec" else spec[0])
net = PipelineModule(
    layers=layers,
    loss_fn=torch.nn.CrossEntropyLoss(),
    num_stages=args.stages,
    partition_method="uniform",
    seed_layers=True,  # every layer built under seed base_seed + index, on whichever stage it lives
    activation_checkpoint_interval=0,
)
trainset = image_dataset()
engine, _, _, _ = deepspeed.initialize(
    args=args, model=net, model_parameters=[p for p in net.parameters() if p.requires_grad], training_data=trainset
)
loader = RepeatingLoader(torch.utils.data.DataLoader(trainset, batch_size=engine.train_micro_batch_size_per_gpu() if args.engine_loader else 4))
data_iter = iter(loader)
losses = []
for step in range(args.steps):
    loss = engine.train_batch() if args.engine_loader else engine.train_batch(data_iter=data_iter)
    losses.append(float(loss))
    if deepspeed.comm.get_rank() == 0:
        print(f"step {step} loss {losses[-1]:.6f}", flush=True)
report(args.out, {"losses": losses})
