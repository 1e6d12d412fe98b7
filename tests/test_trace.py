"""profile=true: a Chrome trace and a top-ops table of steady-state steps, its refusal with cuda_graph, and the
step's anatomy per kernel class (CUDA kernel names as recorded on GPUs, CPU op self time here)."""

import gzip
import json

import pytest
import torch

from vitreg.errors import VitregError
from vitreg.hardware.precision import precision_of
from vitreg.hardware.profiles import PROFILES, DetectedHardware, ResolvedHardware
from vitreg.measure.anatomy import CLASSES, Anatomy, ceilings, device_times, host_times, kernel_class
from vitreg.measure.traces import TOP_OPS, check_profile_request, trace_steps


def test_trace_and_table_of_the_steps_after_warmup(tmp_path):
    import timm

    model = timm.create_model("test_vit", pretrained=False, img_size=32).eval()
    x = torch.randn(2, 3, 32, 32)
    calls = []

    def step():
        calls.append(1)
        with torch.inference_mode():
            model(x)

    files = trace_steps(step, steps=2, device="cpu", out_dir=tmp_path / "profile")
    assert len(calls) == 3 and files.steps == 2  # one warm-up step, untraced, then the two traced ones
    trace = json.loads(gzip.decompress(files.trace.read_bytes()))
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::linear" in names and "aten::_scaled_dot_product_flash_attention_for_cpu" in names
    table = files.ops_table.read_text().splitlines()
    assert "Self CPU" in table[1]
    rows = [line for line in table[3:] if line.strip() and not line.startswith(("-", "Self CPU time total"))]
    assert 0 < len(rows) <= TOP_OPS
    # the same steps per kernel class: CPU op self time (no device kernels); which class is the largest depends
    # on the host's load (a loaded host read "other"), so each class the model's ops fall in holds time
    assert files.host and set(files.class_us) == set(CLASSES)
    assert {kernel_class(n) for n in ("aten::addmm", "aten::_scaled_dot_product_flash_attention_for_cpu",
                                      "aten::native_layer_norm")} == {"matmul", "attention", "norm_pointwise"}
    assert all(files.class_us[c] > 0 for c in ("matmul", "attention", "norm_pointwise", "idle")), files.class_us


def test_profile_with_cuda_graph_is_refused_in_one_line():
    with pytest.raises(VitregError) as err:
        check_profile_request(profile=True, cuda_graph=True)
    assert "use cuda_graph=false to profile" in str(err.value) and "\n" not in str(err.value)
    check_profile_request(profile=True, cuda_graph=False)
    check_profile_request(profile=False, cuda_graph=True)


#: Kernel names as torch.profiler records them on NVIDIA GPUs (H100/H200 cuBLAS, cuDNN, FlashAttention, xformers,
#: inductor's triton kernels, torchao's fp8 steps eager and compiled) and CPU op names, with the class each is.
RECORDED = {
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel__5x_"
    "cublas": "matmul",
    "nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT": "matmul",
    "nvjet_qqtst_128x256_128x6_1x2_h_bz_coopA_NNT": "matmul",  # an fp8 GEMM
    "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_"
    "cublas": "matmul",  # fp8 (e4m3) inputs: still the matmul
    "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_128x128_32x5_tn_align8>(cutlass_80_tensorop_"
    "bf16_s16816gemm_relu_bf16_128x128_32x5_tn_align8::Params)": "matmul",
    "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn": "matmul",
    "void cublasLt::splitKreduce_kernel<(int)32, (int)16, int, float, __nv_bfloat16, float>": "matmul",
    "sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64_warpgroupsize1x1x1_g1_execute_"
    "kernel__5x_cudnn": "matmul",  # the patch embedding's convolution
    "triton_tem_fused_addmm_0": "matmul",  # max-autotune's template
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t, "
    "Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t> >, false, false, false, false, true, true, false, "
    "false>(pytorch_flash::Flash_fwd_params)": "attention",  # says cutlass too
    "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, "
    "cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)": "attention",
    "fmha_cutlassB_bf16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<cutlass::arch::Sm80, "
    "cutlass::bfloat16_t, true, false, false, 64, 64, 64, false>::Params)": "attention",
    "cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x64_4x1x1_kernel0_0": "attention",
    "triton_per_fused__to_copy_add_native_layer_norm_2": "norm_pointwise",  # a cast fused into a norm: the norm
    "triton_red_fused__to_copy_add_native_layer_norm_native_layer_norm_backward_5": "norm_pointwise",
    "triton_poi_fused_addmm_gelu_3": "norm_pointwise",  # the matmul's epilogue, not the matmul
    "triton_poi_fused__scaled_dot_product_efficient_attention_0": "norm_pointwise",  # attention's input, not it
    "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float, false>(int, float, "
    "c10::BFloat16 const*, c10::BFloat16 const*, c10::BFloat16 const*, float*, float*, c10::BFloat16*)":
        "norm_pointwise",
    "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, "
    "at::native::GeluType)::{lambda()#2}::operator()() const::{lambda(c10::BFloat16)#1}, at::detail::Array<char*, 2> "
    ">(int, ...)": "norm_pointwise",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
    "at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)": "norm_pointwise",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
    "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
    "(at::native::ADAM_MODE)1, false>, float*, float, float, float, float, float, bool, float const*, float const*>":
        "norm_pointwise",
    "triton_red_fused_abs_amax_0": "quantize_cast",  # compiled fp8: the scale's amax
    "triton_poi_fused__to_copy_clamp_div_mul_reciprocal_1": "quantize_cast",  # compiled fp8: scale and cast
    "triton_poi_fused__to_copy_0": "quantize_cast",  # a cast alone
    "void at::native::vectorized_elementwise_kernel<(int)4, at::native::float8_copy_kernel_cuda(at::TensorIteratorBase"
    " &)::[lambda(float) (instance 1)], std::array<char *, (unsigned long)2>>(int, T2, T3)": "quantize_cast",
    "void at::native::vectorized_elementwise_kernel<(int)4, at::native::AbsFunctor<float>, std::array<char *, "
    "(unsigned long)2>>(int, T2, T3)": "quantize_cast",  # eager fp8: the scale's |x|
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::"
    "{lambda()#3}::operator()() const::{lambda(float)#1}, at::detail::Array<char*, 2>>(int, ...)": "quantize_cast",
    "Memcpy HtoD (Pageable -> Device)": "memcpy",
    "Memset (Device)": "memcpy",
    "void cudnn::ops::nchwToNhwcKernel<__nv_bfloat16, __nv_bfloat16, float, false, true, "
    "(cudnnKernelDataType_t)2>(cudnn::ops::nchw2nhwc_params_t<float>, __nv_bfloat16 const*, __nv_bfloat16*)": "memcpy",
    "triton_poi_fused_clone_0": "memcpy",  # a layout copy alone
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "other",
    "aten::addmm": "matmul", "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    "aten::native_layer_norm": "norm_pointwise", "aten::add_": "norm_pointwise", "aten::_to_copy": "quantize_cast",
    "aten::copy_": "memcpy", "aten::topk": "other", "aten::view": "other",
}


@pytest.mark.parametrize("name", RECORDED)
def test_each_recorded_kernel_name_has_its_class(name):
    assert kernel_class(name) == RECORDED[name]


def test_device_time_counts_overlapping_kernels_once_and_the_gaps_between_them_as_idle():
    kernels = [("sm90_xmma_gemm_bf16", 0, 60), ("flash_fwd_kernel", 50, 80),  # overlap 50-60 on two streams
               ("Memset (Device)", 100, 110)]  # 20 µs of no kernel before it
    times = device_times(kernels)
    assert (times["matmul"], times["attention"], times["memcpy"], times["idle"]) == (60, 30, 10, 20)
    assert device_times([("nvjet_tst", 0, 100), ("flash_fwd_kernel", 10, 20)])["idle"] == 0  # the span ends at 100
    assert device_times([]) == dict.fromkeys(CLASSES, 0.0)


def test_on_a_gpu_the_classes_are_the_device_kernels_and_not_the_ranges_drawn_over_them():
    """torch.profiler's events of a CUDA run as the trace holds them: the CPU ops that launched the kernels and the
    device-side range of record_function (inductor's compiled region) are not kernel time."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from vitreg.measure.traces import _class_us

    def event(name, start, end, device=DeviceType.CUDA, annotation=False):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                               is_user_annotation=annotation, self_cpu_time_total=end - start, cpu_parent=None)

    events = [event("aten::addmm", 0, 5, DeviceType.CPU), event("Torch-Compiled Region: 0/0", 0, 100, annotation=True),
              event("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT", 10, 50),
              event("triton_per_fused__to_copy_add_native_layer_norm_2", 60, 70)]
    times = _class_us(events, cuda=True)
    assert (times["matmul"], times["norm_pointwise"], times["other"], times["idle"]) == (40, 10, 0, 10)


def test_host_time_outside_any_op_is_idle_and_never_below_zero():
    assert host_times([("aten::addmm", 70.0), ("aten::gelu", 20.0)], span_us=100.0)["idle"] == 10.0
    assert host_times([("aten::addmm", 120.0)], span_us=100.0)["idle"] == 0.0  # intra-op threads


def _h200(label="h200"):
    detected = DetectedHardware("cuda", "NVIDIA H200", 1, PROFILES["h200"])
    return ResolvedHardware(label, PROFILES.get(label, PROFILES["h200"]), detected, label != "h200")


def test_the_ceilings_are_the_precisions_datasheet_peaks_and_unknown_without_one():
    assert ceilings(precision_of("bf16"), _h200()) == {"matmul": 989.4, "attention": 989.4}
    assert ceilings(precision_of("fp8"), _h200()) == {"matmul": 1978.9, "attention": 989.4}  # SDPA stays bf16
    assert ceilings(precision_of("off"), ResolvedHardware("cpu", PROFILES["cpu"], None, False)) == \
        {"matmul": None, "attention": None}
    assert ceilings(precision_of("bf16"), _h200("a100")) == {}  # a mislabelled run: its label's peak is not its own


def test_anatomy_per_image_shares_and_achieved_tflops_against_the_ceiling():
    """2 steps of 100 images: 80 ms of matmul kernels is 0.4 ms/img; 1 GFLOP/img of matmul in 0.4 ms is 2.5 TFLOP/s."""
    times = {**dict.fromkeys(CLASSES, 0.0), "matmul": 80_000.0, "attention": 10_000.0, "idle": 10_000.0}
    anatomy = Anatomy(times, steps=2, batch=100, host=False, flops_per_img={"matmul": 1e9, "attention": 0},
                      ceiling_tflops={"matmul": 10.0, "attention": None})
    figures = anatomy.figures()
    assert figures["anatomy_matmul_ms_per_img"] == pytest.approx(0.4)
    assert figures["anatomy_matmul_pct"] == pytest.approx(80.0) and figures["anatomy_idle_pct"] == pytest.approx(10)
    assert sum(figures[f"anatomy_{c}_pct"] for c in CLASSES) == pytest.approx(100.0)
    assert figures["anatomy_matmul_tflops"] == pytest.approx(2.5) and figures["anatomy_attention_tflops"] is None
    rows = {line.split("  ")[0]: line.split() for line in anatomy.table("infer").splitlines()[3:]}
    assert rows["matmul"][-3:] == ["2.5", "10", "25"]  # TFLOP/s, the ceiling, 25 % of it
    assert rows["attention"][-3:] == ["unknown"] * 3 and "GPU kernel time" in anatomy.table("infer")
    assert anatomy.largest() == ["matmul", "attention"]
    assert anatomy.line("infer").startswith("infer: step anatomy (GPU time): matmul 80 % (0.4000 ms/img), attention")
