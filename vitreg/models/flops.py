"""FLOPs per image, counted on the real model with PyTorch's FlopCounterMode (never assumed)."""

from __future__ import annotations


def count_flops(fn, *args) -> int:
    """FLOPs of one call of ``fn(*args)`` as PyTorch's FlopCounterMode counts them (2 per multiply-add).

    It counts the matrix products and attention that dominate a ViT; element-wise work (GELU,
    LayerNorm, softmax) is not counted, which is the usual convention for MFU.
    """
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        fn(*args)
    return int(counter.get_total_flops())


def forward_flops_per_image(model, img_size: int, device) -> int:
    """Forward FLOPs for one image, counted on the real (uncompiled) model in eval mode."""
    import torch

    was_training = model.training
    model.eval()
    try:
        x = torch.randn(1, 3, img_size, img_size, device=device)
        with torch.no_grad():
            return count_flops(model, x)
    finally:
        model.train(was_training)


def train_flops_per_image(model, img_size: int, device, loss_fn) -> int:
    """Forward + backward FLOPs for one image (about 3x the forward), counted, not assumed."""
    import torch

    was_training = model.training
    model.train()
    try:
        x = torch.randn(1, 3, img_size, img_size, device=device)
        y = torch.zeros(1, dtype=torch.long, device=device)

        def step():
            loss_fn(model(x), y).backward()

        flops = count_flops(step)
        model.zero_grad(set_to_none=True)
        return flops
    finally:
        model.train(was_training)
