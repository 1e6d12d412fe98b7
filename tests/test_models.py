import sys
from dataclasses import astuple

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


def test_a_name_listed_before_is_checked_without_importing_timm(tmp_path, monkeypatch):
    """The DDP launcher's check: timm's names as an earlier process listed them, read from the user's cache."""
    from vitreg.models import factory, known

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    factory._timm_names.cache_clear()
    names = factory._timm_names()  # lists timm's names, and keeps them for the next process
    assert known.cache_file().parent == tmp_path / "vitreg" and known.names() == set(names)
    assert "test_vit" in names and "resnet50" not in names

    monkeypatch.setitem(sys.modules, "timm", None)  # any `import timm` now fails
    factory.check_model_name("vit_base_patch16_224")
    with pytest.raises(ImportError):
        factory.check_model_name("resnet50")  # not listed: only timm can say what it is


def test_an_edited_cache_file_never_lets_a_bad_model_build_nor_refuses_a_job(tmp_path, monkeypatch):
    from vitreg.models import factory, known, memory

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    known.keep(names=("vit_no_such_model", "resnet_not_a_vit"),
               sizes={"footprint:test_vit:32:10": (10**15, 1, 1, 1, 32), "footprint:vit_x:0:1000": ("a", -1)})
    factory.check_model_name("vit_no_such_model")  # a launcher takes it...
    with pytest.raises(VitregError, match="unknown model 'vit_no_such_model'"):
        create_model("vit_no_such_model", 32)  # ...and the process that builds the model refuses it
    with pytest.raises(VitregError, match="unknown model 'resnet_not_a_vit'"):
        factory.check_model_name("resnet_not_a_vit")  # outside timm's ViT/DeiT prefixes: never read
    assert known.sizes("footprint:vit_x:0:1000") is None  # not integers: not taken
    # a petabyte of weights, as the edited file says: the refusal is checked against the model itself
    memory.check_ranks_fit(2, "test_vit", 32, 10, "cpu")
    assert known.sizes("footprint:test_vit:32:10") == astuple(memory.footprint("test_vit", 32, 10))
    known.cache_file().write_text("not json")
    assert known.names() == frozenset() and known.sizes("footprint:test_vit:32:10") is None


def test_an_unwritable_cache_only_costs_the_import(tmp_path, monkeypatch):
    from vitreg.models import factory, known

    (tmp_path / "vitreg").write_text("a file where the folder would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    factory._timm_names.cache_clear()
    assert "test_vit" in factory._timm_names() and known.names() == frozenset()
    assert list(tmp_path.iterdir()) == [tmp_path / "vitreg"]


def test_the_cache_keeps_the_most_recent_footprints_only(tmp_path, monkeypatch):
    from vitreg.models import known

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for size in range(known.MAX_SIZES + 10):
        known.keep(sizes={f"footprint:test_vit:{size}:10": (1, 2, 3, 4, size)})
    assert known.sizes("footprint:test_vit:9:10") is None and known.sizes("footprint:test_vit:10:10") is not None
    known.keep(sizes={"footprint:test_vit:12:10": (1, 2, 3, 4, 12)})  # asked again: now the newest
    known.keep(sizes={"footprint:test_vit:100:10": (1, 2, 3, 4, 100), "footprint:test_vit:101:10": (1, 2, 3, 4, 101)})
    assert [known.sizes(f"footprint:test_vit:{size}:10") is None for size in (10, 11, 12, 13, 101)] == [
        True, True, False, False, False]
