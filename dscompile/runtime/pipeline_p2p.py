"""Point-to-point transport between pipeline stages over torch.distributed.

Sends are non-blocking (``isend``; handles kept until ``wait_all``), receives block until the
tensor is there, and every message carries a tag naming (activation|gradient, producer stage,
consumer stage, output index, micro-batch), so gloo matches messages by tag whatever order the
schedule posts them in. Stages on the same rank hand tensors over locally.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dscompile.runtime import comm_stats
from dscompile.runtime.devices import collective_device

ACTIVATION, GRADIENT = 0, 1
_MAX_STAGES, _MAX_OUTPUTS, _MAX_MICRO = 64, 64, 1024


def message_tag(kind: int, src_stage: int, dst_stage: int, output: int, micro_batch: int) -> int:
    """A unique tag below 2**31 for one tensor of one micro-batch on one stage boundary."""
    if src_stage >= _MAX_STAGES or dst_stage >= _MAX_STAGES or output >= _MAX_OUTPUTS:
        raise ValueError(f"pipeline transport supports up to {_MAX_STAGES} stages and {_MAX_OUTPUTS} tensors per boundary")
    mb = micro_batch % _MAX_MICRO
    return (((kind * _MAX_STAGES + src_stage) * _MAX_STAGES + dst_stage) * _MAX_OUTPUTS + output) * _MAX_MICRO + mb


class P2P:
    """Tagged send/recv between global ranks; local hand-over when both ends are this rank."""

    def __init__(self, rank: int, device: torch.device | None = None) -> None:
        self.rank = rank
        # receive buffers (and the gradients the executor makes) live where the backend needs them
        self.device = device or collective_device()
        self._pending: list[tuple[Any, torch.Tensor]] = []
        self._local: dict[int, torch.Tensor] = {}
        self.bytes_sent = 0

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        data = tensor.detach()
        if dst == self.rank:
            self._local[tag] = data
            return
        data = data.contiguous()
        self._pending.append((dist.isend(data, dst, tag=tag), data))
        self.bytes_sent += data.numel() * data.element_size()
        comm_stats.record("pipeline", "p2p_send", data.numel() * data.element_size())

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, tag: int) -> torch.Tensor:
        if src == self.rank:
            if tag not in self._local:
                raise RuntimeError(f"pipeline: local tensor with tag {tag} was never produced; the schedule runs a consumer before its producer")
            return self._local.pop(tag)
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(buffer, src, tag=tag)
        comm_stats.record("pipeline", "p2p_recv", buffer.numel() * buffer.element_size())
        return buffer

    def wait_all(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
        if self._local:
            raise RuntimeError(f"pipeline: {len(self._local)} local tensors were sent but never received")
