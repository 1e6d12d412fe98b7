import pytest
import torch

from vitreg.errors import VitregError
from vitreg.models.factory import create_model
from vitreg.models.flops import count_flops, forward_flops_per_image


def test_flop_counter_matches_a_hand_count_for_linear():
    layer = torch.nn.Linear(64, 32)
    x = torch.randn(8, 64)
    # one multiply-add per weight per row: 2 * batch * in * out
    assert count_flops(layer, x) == 2 * 8 * 64 * 32


def test_vit_forward_flops_match_the_matmul_count():
    model, info = create_model("test_vit", 32)
    assert info.img_size == 32 and info.source == "timm"
    flops = forward_flops_per_image(model, 32, "cpu")
    d, tokens = model.embed_dim, (32 // info.patch_size) ** 2 + 1
    hidden = model.blocks[0].mlp.fc1.out_features
    linear = 2 * tokens * d * (3 * d + d + 2 * hidden)  # qkv, proj, fc1, fc2
    attention = 2 * (2 * tokens * tokens * d)  # q @ k^T and attn @ v
    patch = 2 * (tokens - 1) * (3 * info.patch_size ** 2) * d  # the patch-embedding conv
    head = 2 * d * info.num_classes
    expected = len(model.blocks) * (linear + attention) + patch + head
    assert flops == pytest.approx(expected, rel=0.02)


def test_img_size_not_a_multiple_of_the_patch():
    with pytest.raises(VitregError, match="use img_size=16 or 32"):
        create_model("test_vit", 30)


def test_unknown_model_suggests_close_names():
    with pytest.raises(VitregError, match="did you mean vit_base_patch16_224"):
        create_model("vit_bsae_patch16_224")


def test_non_vit_refused():
    with pytest.raises(VitregError, match="is not a ViT/DeiT"):
        create_model("resnet18")


def test_torchvision_and_distilled():
    model, info = create_model("torchvision:vit_b_16", 32)
    assert info.source == "torchvision" and info.patch_size == 16
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 1000)
    _, dinfo = create_model("deit_tiny_distilled_patch16_224", 32)
    assert dinfo.distilled
    with pytest.raises(VitregError, match="torchvision:vit_b_16"):
        create_model("torchvision:vit_b_61")
