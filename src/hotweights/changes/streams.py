"""Waiting for the device work queued on tensors before they are read."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def settle(tensors: Mapping[str, torch.Tensor]) -> None:
    """Wait for the work queued on every stream of the tensors' devices: an optimizer step
    on a side stream lands before the tensors are hashed, copied or sent (that work runs on
    the default stream, which does not wait for the others; a CUDA IPC reader's streams
    are not ordered after ours at all)."""
    for device in {t.device for t in tensors.values() if t.device.type not in ("cpu", "meta")}:
        torch.accelerator.synchronize(device)
