"""Sizes nobody can run are refused from their memory floor, before anything is allocated."""

import pytest

from vitreg.errors import VitregError
from vitreg.models.factory import create_model
from vitreg.models.memory import GIB, check_step_fits, footprint, minimum_bytes


def test_footprint_matches_the_real_model():
    fp = footprint("test_vit", 32)
    model, info = create_model("test_vit", 32)
    assert fp.params == sum(p.numel() for p in model.parameters())
    assert fp.tokens == model.pos_embed.shape[1] and fp.width == model.embed_dim and fp.depth == len(model.blocks)


def test_torchvision_footprint():
    fp = footprint("torchvision:vit_b_16", 224)
    assert (fp.tokens, fp.width, fp.depth) == (197, 768, 12) and 86e6 < fp.params < 87e6


def test_an_image_a_million_pixels_wide_is_refused_before_building():
    with pytest.raises(VitregError, match=r"img_size=1000000 has .* M parameters .* use a smaller img_size"):
        create_model("vit_base_patch16_224", 1_000_000)  # ~12 TB of position embeddings: never allocated


def test_a_batch_of_millions_is_refused_with_a_batch_that_fits():
    fp = footprint("vit_base_patch16_224")
    with pytest.raises(VitregError, match=r"batch_size=2000000, .* needs at least .* GPU 0 has 139.0 GiB free: "
                                          r"use batch_size=\d+ or less"):
        check_step_fits(fp, 2_000_000, train=True, available=139 * GIB, where="GPU 0")
    check_step_fits(fp, 256, train=True, available=139 * GIB, where="GPU 0")  # timm's default batch fits


def test_the_floor_is_below_what_a_real_step_holds():
    """The bound never refuses what runs: a real CPU training step holds more than the floor (weights,
    gradients and AdamW's moments counted from the tensors, activations from what autograd saves)."""
    import torch

    fp = footprint("test_vit", 32)
    model, _ = create_model("test_vit", 32)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(8, 3, 32, 32)
    saved = []

    def keep(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        loss = model(x).sum()
    loss.backward()
    opt.step()
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters()]
    tensors += [v for state in opt.state.values() for v in state.values() if torch.is_tensor(v) and v.dim()]
    held = sum(t.numel() * t.element_size() for t in tensors) + x.numel() * x.element_size() + sum(saved)
    assert 0 < minimum_bytes(fp, 8, train=True) <= held
