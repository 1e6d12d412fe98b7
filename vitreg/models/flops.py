"""FLOPs per image, counted on the real model with PyTorch's FlopCounterMode (never assumed)."""

from __future__ import annotations


def count_flops(fn, *args, attention: bool = False) -> int:
    """FLOPs of one call of ``fn(*args)`` as PyTorch's FlopCounterMode counts them (2 per multiply-add).

    It counts the matrix products and attention that dominate a ViT; element-wise work (GELU,
    LayerNorm, softmax) is not counted, which is the usual convention for MFU. ``attention``: only
    the fused attention ops' (SDPA's flash, efficient and cuDNN kernels, forward and backward), which a
    step's anatomy puts beside the attention kernels' time; the total less them is the matmuls'.
    """
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        fn(*args)
    if attention:
        return int(sum(n for op, n in counter.get_flop_counts()["Global"].items() if "attention" in str(op)))
    return int(counter.get_total_flops())


def forward_flops_per_image(model, img_size: int, device, attention: bool = False) -> int:
    """Forward FLOPs for one image, counted on the real (uncompiled) model in eval mode (``attention``: see
    :func:`count_flops`)."""
    import torch

    was_training = model.training
    model.eval()
    try:
        x = torch.randn(1, 3, img_size, img_size, device=device)
        with torch.no_grad():
            return count_flops(model, x, attention=attention)
    finally:
        model.train(was_training)


def train_flops_per_image(model, img_size: int, device, loss_fn, attention: bool = False) -> int:
    """Forward + backward FLOPs for one image (about 3x the forward), counted, not assumed (``attention``: see
    :func:`count_flops`)."""
    import torch

    was_training = model.training
    model.train()
    try:
        x = torch.randn(1, 3, img_size, img_size, device=device)
        y = torch.zeros(1, dtype=torch.long, device=device)

        def step():
            loss_fn(model(x), y).backward()

        flops = count_flops(step, attention=attention)
        model.zero_grad(set_to_none=True)
        return flops
    finally:
        model.train(was_training)
