"""FLOPs per image, counted on the real model with PyTorch's FlopCounterMode (never assumed)."""

from __future__ import annotations

import contextlib


def count_flops(fn, *args, attention: bool = False) -> int:
    """FLOPs of ``fn(*args)`` as FlopCounterMode counts them: matmuls and attention, not element-wise work (the
    convention for MFU). ``attention``: only the fused attention ops', which a step's anatomy sets beside their time."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        fn(*args)
    if attention:
        return int(sum(n for op, n in counter.get_flop_counts()["Global"].items() if "attention" in str(op)))
    return int(counter.get_total_flops())


@contextlib.contextmanager
def _mode(model, training: bool):
    was_training = model.training
    model.train(training)
    try:
        yield
    finally:
        model.train(was_training)


def forward_flops_per_image(model, img_size: int, device, attention: bool = False) -> int:
    """Forward FLOPs of one image on the real (uncompiled) model in eval mode."""
    import torch

    with _mode(model, False), torch.no_grad():
        return count_flops(model, torch.randn(1, 3, img_size, img_size, device=device), attention=attention)


def train_flops_per_image(model, img_size: int, device, loss_fn, attention: bool = False) -> int:
    """Forward + backward FLOPs of one image (about 3x the forward), counted, not assumed."""
    import torch

    x = torch.randn(1, 3, img_size, img_size, device=device)
    y = torch.zeros(1, dtype=torch.long, device=device)
    with _mode(model, True):
        flops = count_flops(lambda: loss_fn(model(x), y).backward(), attention=attention)
        model.zero_grad(set_to_none=True)
        return flops
