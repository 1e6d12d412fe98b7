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
    with pytest.raises(VitregError, match="is not a vision transformer vitreg builds"):
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
    from vitreg.models import families, learned_facts

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    families._timm_listed.cache_clear()
    names = families._timm_listed()  # lists timm's names, and keeps them for the next process
    assert learned_facts.cache_file().parent == tmp_path / "vitreg" and learned_facts.names() == set(names)
    assert "test_vit" in names and "resnet50" not in names

    families._timm_source()  # timm's source, read as text (a process reads it once, without importing timm)
    monkeypatch.setitem(sys.modules, "timm", None)  # any `import timm` now fails
    families.check_name("vit_base_patch16_224")
    with pytest.raises(VitregError, match="'resnet50' is not a vision transformer"):
        families.check_name("resnet50")  # not listed: timm's source says what it is, without importing timm


def test_an_edited_cache_file_never_lets_a_bad_model_build_nor_refuses_a_job(tmp_path, monkeypatch):
    from vitreg.models import families, learned_facts, memory

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    learned_facts.keep(names=("vit_no_such_model", "resnet_not_a_vit"),
               sizes={"footprint:test_vit:32:10": (10**15, 1, 1, 1, 32), "footprint:vit_x:0:1000": ("a", -1)})
    families.check_name("vit_no_such_model")  # a launcher takes it...
    with pytest.raises(VitregError, match="unknown model 'vit_no_such_model'"):
        create_model("vit_no_such_model", 32)  # ...and the process that builds the model refuses it
    with pytest.raises(VitregError, match="unknown model 'resnet_not_a_vit'"):
        families.check_name("resnet_not_a_vit")  # outside timm's ViT/DeiT prefixes: never read
    assert learned_facts.sizes("footprint:vit_x:0:1000") is None  # not integers: not taken
    # a petabyte of weights, as the edited file says: the refusal is checked against the model itself
    memory.check_ranks_fit(2, "test_vit", 32, 10, "cpu")
    assert learned_facts.sizes("footprint:test_vit:32:10") == astuple(memory.footprint("test_vit", 32, 10))
    learned_facts.cache_file().write_text("not json")
    assert learned_facts.names() == frozenset() and learned_facts.sizes("footprint:test_vit:32:10") is None


def test_an_unwritable_cache_only_costs_the_import(tmp_path, monkeypatch):
    from vitreg.models import families, learned_facts

    (tmp_path / "vitreg").write_text("a file where the folder would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    families._timm_listed.cache_clear()
    assert "test_vit" in families._timm_listed() and learned_facts.names() == frozenset()
    assert list(tmp_path.iterdir()) == [tmp_path / "vitreg"]


def test_the_cache_keeps_the_most_recent_footprints_only(tmp_path, monkeypatch):
    from vitreg.models import learned_facts

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for size in range(learned_facts.MAX_SIZES + 10):
        learned_facts.keep(sizes={f"footprint:test_vit:{size}:10": (1, 2, 3, 4, size)})
    assert learned_facts.sizes("footprint:test_vit:9:10") is None and learned_facts.sizes("footprint:test_vit:10:10") is not None
    learned_facts.keep(sizes={"footprint:test_vit:12:10": (1, 2, 3, 4, 12)})  # asked again: now the newest
    learned_facts.keep(sizes={"footprint:test_vit:100:10": (1, 2, 3, 4, 100), "footprint:test_vit:101:10": (1, 2, 3, 4, 101)})
    assert [learned_facts.sizes(f"footprint:test_vit:{size}:10") is None for size in (10, 11, 12, 13, 101)] == [
        True, True, False, False, False]


@pytest.mark.parametrize("name, message", [
    ("torchvision:swin_t", r"unknown model 'torchvision:swin_t': use one of torchvision:vit_b_16, "),
    ("torchvision:", r"unknown model 'torchvision:': use one of torchvision:vit_b_16"),
    ("resnet18", r"'resnet18' is not a vision transformer vitreg builds: use a name starting with vit_, "),
    ("swin_tiny_patch4_window7_224", r"is not a vision transformer vitreg builds"),
    ("no_such_family_at_all", r"unknown model 'no_such_family_at_all': use a name starting with vit_"),
    ("vit_", r"unknown model 'vit_'"),
    ("", r"unknown model ''"),
])
def test_a_name_no_family_builds_is_one_line_before_any_work(name, message):
    """Refused by the name alone: nothing is built, not even on the meta device."""
    from vitreg.models import memory

    memory.footprint.cache_clear()
    with pytest.raises(VitregError, match=message) as err:
        create_model(name, 0, 10)
    assert "\n" not in str(err.value)
    assert memory.footprint.cache_info().currsize == 0


@pytest.mark.parametrize("name, img_size, patch, tokens", [
    ("vit_tiny_patch16_224", 32, 16, 4 + 1),
    ("deit_tiny_distilled_patch16_224", 32, 16, 4 + 2),  # class and distillation tokens
    ("eva02_tiny_patch14_224", 28, 14, 4 + 1),  # a family added by one registration
    ("torchvision:vit_b_32", 64, 32, 4 + 1),
])
def test_each_family_builds_and_reads_its_layout(name, img_size, patch, tokens):
    from vitreg.hardware.sdpa import attention_shape
    from vitreg.models.memory import footprint

    model, info = create_model(name, img_size, 10)
    assert info.patch_size == patch and info.img_size == img_size
    assert model(torch.randn(1, 3, img_size, img_size))[0].shape[-1] == 10
    heads, head_dim, seq = attention_shape(model)
    fp = footprint(name, img_size, 10)
    assert seq == tokens == fp.tokens and heads * head_dim == fp.width


def test_a_hybrid_vit_has_its_backbone_stride_as_patch_size():
    """vit_small_r26_s32: a ResNet stem of stride 32 under a patch embedding of 1: 7 x 7 tokens at 224 px, not
    224 x 224 (which made its memory floor 1000x too high)."""
    from vitreg.models.memory import footprint

    fp = footprint("vit_small_r26_s32_224", 0, 10)
    assert fp.tokens == 7 * 7 + 1
    with pytest.raises(VitregError, match="patch size 32: use img_size=32 or 64"):
        create_model("vit_small_r26_s32_224", 48)


def test_a_family_is_one_registration():
    """A new prefix registered is built, listed and read like the built-in ones; a taken prefix is refused."""
    from vitreg.models import families

    family = families.TimmFamily("vit_tiny_")  # a narrower prefix: the longest match owns the name
    with pytest.raises(ValueError, match="registered already"):
        families.register_family(families.TimmFamily("deit_"))
    families.register_family(family)
    try:
        assert families.family_of("vit_tiny_patch16_224") is family
        assert families.family_of("vit_small_patch16_224") is not family
        assert "vit_tiny_patch16_224" in families.all_names(listed_before_ok=False)
        model, info = create_model("vit_tiny_patch16_224", 32, 10)
        assert families.family_of_model(model).architecture(model).tokens == 5
    finally:
        families._FAMILIES.remove(family)


def test_torchvision_swin_is_one_error_line_from_the_cli(sqlite_store):
    """The case of the issue: torchvision's swin_t once reached int('t') parsing a patch size from the name."""
    from click.testing import CliRunner

    from vitreg.cli.main import main

    res = CliRunner().invoke(main, ["bench", "--model", "torchvision:swin_t", "--device", "cpu", "--experiment", "swin"])
    assert res.exit_code == 2 and "Traceback" not in res.output, (res.output[-2000:], res.exception)
    (line,) = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert line.startswith("error: unknown model 'torchvision:swin_t': use one of torchvision:vit_b_16")
