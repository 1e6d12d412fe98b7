"""What the training loop measures besides the loss: validation top-1 and the gradient norm."""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.no_grad()
def evaluate(model, data, runtime) -> tuple[float, float]:
    """Top-1 (percent) and mean CE over ``data.val``, on the plain model in eval mode (a distilled DeiT
    averages its two heads there)."""
    was_training = model.training
    model.eval()
    device = runtime.torch_device
    correct = torch.zeros((), dtype=torch.long, device=device)
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    count = 0
    try:
        for images, labels in data.val_batches():
            with runtime.autocast():
                out = model(images)
            if isinstance(out, (tuple, list)):
                out = sum(out) / len(out)
            out = out.float()
            loss_sum += F.cross_entropy(out, labels, reduction="sum")
            correct += (out.argmax(dim=1) == labels).sum()
            count += labels.numel()
    finally:
        model.train(was_training)
    if not count:
        return float("nan"), float("nan")
    return correct.item() * 100.0 / count, loss_sum.item() / count  # the sync, once, after the loop


def grad_norm(parameters) -> torch.Tensor:
    grads = [p.grad for p in parameters if p.grad is not None]
    if hasattr(torch.nn.utils, "get_total_norm"):
        return torch.nn.utils.get_total_norm(grads)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
