"""bf16 weights trained in place: small steps must not vanish to rounding."""

import pytest
import torch

from hotweights.protocol import shm

STEPS, LR = 1000, 1e-3  # an AdamW step is ~lr: below bf16's half-ulp at 1.0 (2**-8)


@pytest.fixture
def shared_ones(tmp_path):
    manifest, tensors = shm.share({"w": torch.ones(64, dtype=torch.bfloat16)},
                                  directory=tmp_path)
    yield tensors["w"]
    shm.release(manifest)


def _train(weight: torch.Tensor, optimizer_cls, **kwargs) -> None:
    param = torch.nn.Parameter(weight, requires_grad=True)  # a view: trains in place
    optimizer = optimizer_cls([param], lr=LR, weight_decay=0.0, **kwargs)
    for _ in range(STEPS):
        param.grad = torch.ones_like(param)
        optimizer.step()


def test_plain_adamw_loses_every_step_to_bf16_rounding(shared_ones):
    _train(shared_ones, torch.optim.AdamW)
    assert torch.equal(shared_ones, torch.ones_like(shared_ones))  # 1000 steps, no movement


def test_kahan_compensated_adamw_moves_bf16_weights(shared_ones):
    optimi = pytest.importorskip("optimi", reason="the train extra: pip install -e '.[train]'")
    _train(shared_ones, optimi.AdamW, kahan_sum=True)
    reference = torch.ones(64, dtype=torch.float32, requires_grad=True)
    optimizer = torch.optim.AdamW([reference], lr=LR, weight_decay=0.0)
    for _ in range(STEPS):
        reference.grad = torch.ones_like(reference)
        optimizer.step()
    # fp32 AdamW moves 1.0 by ~STEPS * LR; the compensated bf16 weights follow it to
    # within one bf16 ulp of the result.
    assert reference[0].item() < 0.1
    torch.testing.assert_close(shared_ones.float(), reference.detach(), atol=2**-7, rtol=0)
