"""DeepSpeed ``init_inference`` with kernel injection against HF eager ``generate``, in a process of its own.

    python bench/gpucheck/deepspeed_decode.py --sizes JSON --rounds N --out FILE [--cpu]

Run by the GPU check's decode section: DeepSpeed JIT-builds its inference ops on the first call (minutes), and
a process of its own can be stopped at the section's deadline. The two peers alternate round by round on the
same model (``decode.build_llama``) and prompt; FILE gets their tokens/s per round, or ``{"error": ...}``.
Tries bf16 first, then fp16 (the dtype DeepSpeed's injected kernels were written for).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # bench/ (for gpucheck) in place of this folder, whose modules would shadow others

import torch  # noqa: E402

from gpucheck.decode import build_llama, prompt_ids  # noqa: E402


def _timed(fn, device: torch.device) -> float:  # noqa: ANN001
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=json.loads, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args()
    d, new = args.sizes, args.sizes["new"]
    device = torch.device("cpu" if args.cpu else "cuda")
    import deepspeed

    errors = []
    for dtype in (torch.bfloat16, torch.float16):
        try:
            hf = build_llama(d, dtype, device)
            ids = prompt_ids(d, device)
            engine = deepspeed.init_inference(build_llama(d, dtype, device), dtype=dtype, replace_with_kernel_inject=True, max_out_tokens=d["prompt"] + new)
            peers = {
                "hf eager": lambda hf=hf, ids=ids: hf.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False),
                "deepspeed": lambda engine=engine, ids=ids: engine.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False),
            }
            first = _timed(peers["deepspeed"], device)
            _timed(peers["hf eager"], device)
            rates: dict[str, list[float]] = {name: [] for name in peers}
            for _ in range(args.rounds):
                for name, fn in peers.items():
                    rates[name].append(new / _timed(fn, device))
            args.out.write_text(json.dumps({**rates, "dtype": str(dtype)[6:], "first_s": first}))
            return
        except Exception as exc:  # kernel injection refused this model or dtype: say so
            errors.append(f"{str(dtype)[6:]}: {type(exc).__name__}: {str(exc)[:120]}")
    args.out.write_text(json.dumps({"error": "; ".join(errors)}))


if __name__ == "__main__":
    main()
