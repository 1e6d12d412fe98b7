"""The optimizer and LR schedule of a training run, DeiT's recipe: AdamW and a warm-up + cosine, per update."""

from __future__ import annotations

import torch

WARMUP_LR_INIT = 1e-6  # DeiT's warmup_lr: where the linear warm-up starts


def build_optimizer(model, spec, runtime):
    """AdamW, weight decay off for biases, norms, position embeddings and tokens (as DeiT/timm).

    ``fused=True`` on CUDA: one kernel for all parameters, and it reads GradScaler's scale and inf
    flag on the device, so an fp16 step needs no host sync for the inf check.
    """
    from timm.optim import param_groups_weight_decay

    no_decay = model.no_weight_decay() if hasattr(model, "no_weight_decay") else ()
    groups = param_groups_weight_decay(model, spec.weight_decay, no_weight_decay_list=no_decay)
    kwargs = {"fused": True} if runtime.device == "cuda" else {}
    return torch.optim.AdamW(groups, lr=spec.lr, betas=(0.9, 0.999), **kwargs)


def build_scheduler(optimizer, spec, total_steps: int):
    """timm's CosineLRScheduler, stepped per update: linear warm-up from 1e-6 over ``warmup_steps``, then a
    cosine from ``lr`` to ``min_lr`` over the remaining ``total_steps - warmup_steps`` updates.

    Update ``u`` (0-based) runs at ``lr_at(u)``: call ``scheduler.step_update(u + 1)`` after it.
    """
    from timm.scheduler import CosineLRScheduler

    warmup = min(spec.warmup_steps, max(total_steps - 1, 0))  # a run shorter than its warm-up still decays
    return CosineLRScheduler(optimizer, t_initial=max(1, total_steps - warmup), lr_min=spec.min_lr,
                             warmup_t=warmup, warmup_lr_init=min(WARMUP_LR_INIT, spec.lr), warmup_prefix=True,
                             t_in_epochs=False)
