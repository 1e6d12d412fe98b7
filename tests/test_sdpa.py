"""SDPA backends: the choice is enforced, checked by a real call, and the backend that ran is read from the ops."""

import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from vitreg.errors import VitregError
from vitreg.hardware.sdpa import attention_shape, backends_in, check_backend, detect_backend, sdpa_context


def tiny_vit():
    import timm

    return timm.create_model("test_vit", pretrained=False, img_size=32).eval()


def infer_step(model):
    x = torch.randn(2, 3, 32, 32)

    def step():
        with torch.inference_mode():
            model(x)
    return step


@pytest.mark.parametrize("choice, ran", [("auto", "flash"), ("flash", "flash"), ("math", "math")])
def test_the_backend_that_ran_is_read_from_the_ops_on_cpu(choice, ran):
    # on CPU torch's default pick is its flash kernel (_scaled_dot_product_flash_attention_for_cpu)
    step = infer_step(tiny_vit())
    with sdpa_context(choice):
        assert detect_backend(step, "cpu") == ran


def test_a_model_that_computes_attention_itself_shows_unfused():
    model = tiny_vit()
    for block in model.blocks:
        block.attn.fused_attn = False  # timm's own q @ k.T, softmax, @ v
    with sdpa_context("flash"):
        assert detect_backend(infer_step(model), "cpu") == "unfused"


def test_a_backend_torch_cannot_run_here_is_refused_in_one_line():
    heads, head_dim, tokens = attention_shape(tiny_vit())
    with pytest.raises(VitregError) as err:
        check_backend("efficient", "cpu", torch.float32, heads, head_dim, tokens)
    message = str(err.value)
    assert message.startswith("sdpa=efficient cannot run on cpu for float32") and "use sdpa=auto" in message
    assert "\n" not in message
    with pytest.raises(VitregError, match="sdpa=cudnn cannot run on cpu"):
        check_backend("cudnn", "cpu", torch.bfloat16, heads, head_dim, tokens)


@pytest.mark.parametrize("choice", ["auto", "flash", "math"])
def test_backends_cpu_has_pass_the_check_forward_and_backward(choice):
    check_backend(choice, "cpu", torch.float32, 2, 32, seq_len=5, backward=True)


def test_attention_shape_of_timm_and_torchvision_vits():
    import torchvision

    assert attention_shape(tiny_vit()) == (2, 32, 5)  # 32 px / patch 16 = 2 x 2 patches + the class token
    assert attention_shape(torchvision.models.vit_b_16(weights=None)) == (12, 64, 197)
    with pytest.raises(VitregError, match="use sdpa=auto"):
        attention_shape(torch.nn.Linear(2, 2))


def test_unknown_choice_is_refused():
    with pytest.raises(VitregError, match="use one of auto, flash, cudnn, efficient, math"):
        sdpa_context("fast")


@pytest.mark.parametrize("names, ran", [
    (["aten::_scaled_dot_product_flash_attention", "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>"],
     "flash"),
    (["aten::_scaled_dot_product_efficient_attention", "fmha_cutlassF_bf16_aligned_64x64_rf_sm80"], "efficient"),
    (["aten::_scaled_dot_product_cudnn_attention", "cudnn_generated_fort_native_sdpa_sm90_flash_fprop"], "cudnn"),
    (["aten::_scaled_dot_product_attention_math", "aten::bmm", "aten::_softmax"], "math"),
    (["fmha_cutlassF_f32_aligned_64x64_rf_sm80", "aten::_scaled_dot_product_attention_math"], "efficient+math"),
    (["aten::addmm", "aten::_softmax", "sm90_xmma_gemm_bf16bf16"], "unfused"),
])
def test_gpu_op_and_kernel_names_map_to_their_backend(names, ran):
    assert backends_in(names) == ran


# timm's attention block, the module its ViTs run attention in, compiled alone: inductor decides about
# the SDPA op the same way as in a whole test_vit, which compiles ~15 more kernels (45 s on 2 cores).
COMPILED_CPU = """
import timm, torch
from vitreg.hardware.sdpa import detect_backend
model = torch.compile(timm.layers.Attention(32, num_heads=2).eval())
x = torch.randn(2, 5, 32)
def step():
    with torch.inference_mode():
        model(x)
step()
print(detect_backend(step, "cpu"))
"""


@pytest.mark.slow
def test_compiled_on_cpu_the_tag_matches_the_op_inductor_generated(tmp_path):
    # Whether inductor keeps torch's CPU flash op or decomposes attention into ops it fuses itself
    # depends on its settings and on what its FX-graph cache holds (an entry compiled under another
    # matmul precision is reused), so the expectation is read from the code inductor generated
    # (TORCH_LOGS=output_code), in a fresh process with an empty cache, not assumed.
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_LOGS": "output_code",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    done = subprocess.run([sys.executable, "-c", COMPILED_CPU], capture_output=True, text=True, timeout=600,
                          cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr
    assert "def call(" in done.stderr, "inductor printed no generated code"
    generated_flash = "_scaled_dot_product_flash_attention_for_cpu" in done.stderr
    assert done.stdout.strip().splitlines()[-1] == ("flash" if generated_flash else "unfused")


def test_run_context_refuses_a_backend_before_the_run_and_holds_the_choice_around_it():
    from vitreg.hardware.profiles import PROFILES, DetectedHardware
    from vitreg.hardware.runtime import resolve_runtime, run_context

    runtime = resolve_runtime("off", "off", "inductor", DetectedHardware("cpu", "CPU", 1, PROFILES["cpu"]))
    model = tiny_vit()
    with pytest.raises(VitregError, match="sdpa=efficient cannot run on cpu"):
        with run_context(runtime, model, "efficient", train=True):
            pytest.fail("the block must not run")
    with run_context(runtime, model, "math") as cache_dir:
        assert cache_dir is None  # not compiling: no cache folder is touched
        assert detect_backend(infer_step(model), "cpu") == "math"
    assert detect_backend(infer_step(model), "cpu") == "flash"  # restored: torch's own pick again


def test_a_replay_of_inductors_graphs_that_shows_no_sdpa_op_is_unknown_not_unfused():
    assert detect_backend(lambda: None, "cpu", replays_graphs=True) == "unknown"
    assert detect_backend(lambda: None, "cpu") == "unfused"
