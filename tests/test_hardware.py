import pytest

from vitreg.errors import VitregError
from vitreg.hardware.precision import precision_of
from vitreg.hardware.profiles import PROFILES, DetectedHardware, match_profile, resolve_hardware


@pytest.mark.parametrize("name,label", [
    ("NVIDIA H200", "h200"),
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H100 PCIe", "h100-pcie"),
    ("NVIDIA A100-SXM4-40GB", "a100"),
    ("NVIDIA A100-PCIE-40GB", "a100"),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
    ("NVIDIA A100 80GB PCIe", "a100-80gb"),
    ("Tesla V100-SXM2-32GB", "v100"),
    ("Tesla T4", "t4"),
    ("NVIDIA L4", "l4"),
    ("NVIDIA GeForce RTX 4090", "rtx4090"),
])
def test_device_names_map_to_labels(name, label):
    assert match_profile(name).label == label


def test_unknown_gpu_gets_its_own_label_and_no_peak():
    p = match_profile("NVIDIA L40S")
    assert p.label == "l40s" and p.peak_tflops == {}
    assert precision_of("bf16").mfu(100.0, p) is None


def test_profile_table_dense_peaks_and_defaults():
    assert PROFILES["a100"].peak_tflops["bf16"] == 312.0
    assert PROFILES["h100"].peak_tflops["fp16"] == pytest.approx(989.4)
    assert PROFILES["h200"].peak_tflops["fp32"] == pytest.approx(66.9)
    assert PROFILES["h200"].peak_tflops["tf32"] == pytest.approx(494.7)
    assert PROFILES["v100"].default_amp == "fp16" and PROFILES["t4"].default_amp == "fp16"
    assert PROFILES["a100"].default_amp == "bf16" and PROFILES["cpu"].default_amp == "off"
    assert not PROFILES["v100"].supports_bf16
    assert precision_of("bf16").mfu(156.0, PROFILES["a100"]) == pytest.approx(0.5)
    assert precision_of("off").mfu(1.0, PROFILES["cpu"]) is None


H200 = DetectedHardware("cuda", "NVIDIA H200", 1, PROFILES["h200"])
CPU = DetectedHardware("cpu", "CPU (test)", 1, PROFILES["cpu"])


def test_auto_takes_the_detected_profile():
    assert resolve_hardware("auto", H200).label == "h200"
    assert resolve_hardware("auto", CPU).label == "cpu"


def test_matching_label_and_alias():
    assert resolve_hardware("H200", H200).label == "h200"
    assert resolve_hardware("a100-40gb", DetectedHardware("cuda", "NVIDIA A100-SXM4-40GB", 1,
                                                          PROFILES["a100"])).label == "a100"


def test_mismatch_is_refused_with_the_right_label():
    with pytest.raises(VitregError) as err:
        resolve_hardware("a100", H200)
    msg = str(err.value)
    assert "NVIDIA H200" in msg and "gpu=h200" in msg and "allow_gpu_mismatch=true" in msg


def test_mismatch_on_cpu_and_override():
    with pytest.raises(VitregError, match="use gpu=cpu"):
        resolve_hardware("a100", CPU)
    hw = resolve_hardware("a100", CPU, allow_mismatch=True)
    assert hw.label == "a100" and hw.mismatch and hw.profile.peak_tflops["bf16"] == 312.0


def test_bf16_refused_on_a_gpu_without_it():
    from vitreg.hardware.runtime import resolve_runtime

    v100 = DetectedHardware("cuda", "Tesla V100-SXM2-32GB", 1, PROFILES["v100"])
    with pytest.raises(VitregError, match="use amp=fp16"):
        resolve_runtime("bf16", "off", "inductor", v100)
    assert resolve_runtime("auto", "off", "inductor", v100).amp == "fp16"
    assert resolve_runtime("auto", "off", "inductor", H200).amp == "bf16"
    assert resolve_runtime("auto", "off", "inductor", CPU).amp == "off"


def test_nccl_env_is_recorded_sorted_and_only_nccl():
    from vitreg.environment import capture_environment, nccl_env

    env = {"NCCL_MAX_CTAS": "8", "PATH": "/bin", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "NCCL_NVLS_ENABLE": "0",
           "MY_NCCL_X": "1"}
    assert nccl_env(env) == "NCCL_MAX_CTAS=8;NCCL_NVLS_ENABLE=0;TORCH_NCCL_ASYNC_ERROR_HANDLING=0"
    assert nccl_env({}) == ""
    assert "nccl_env" in capture_environment().to_tags()


# What NVML (nvidia-smi, torch.cuda.get_device_name) calls each profile's card: the name Ray reads on a node.
DEVICE_NAMES = {"v100": "Tesla V100-SXM2-32GB", "t4": "Tesla T4", "a100": "NVIDIA A100-SXM4-40GB",
                "a100-80gb": "NVIDIA A100-SXM4-80GB", "l4": "NVIDIA L4", "rtx4090": "NVIDIA GeForce RTX 4090",
                "h100-pcie": "NVIDIA H100 PCIe", "h100": "NVIDIA H100 80GB HBM3", "h200": "NVIDIA H200"}


def test_each_profile_s_ray_type_is_what_ray_reports_for_its_card():
    """A sweep's Ray task for gpu=LABEL asks for the profile's ``ray_type``: it must be the accelerator type a Ray
    node with that card reports, as Ray's own NVIDIA manager makes it from the device name (h100-pcie: H100, not
    H100-PCIE; a100-80gb: A100; rtx4090: GeForce-RTX-4090), and that device name must detect the profile."""
    nvidia = pytest.importorskip("ray._private.accelerators.nvidia_gpu")
    from vitreg.fleet.ray_engine import ray_type
    from vitreg.hardware.profiles import label_of_ray_type

    gpus = [label for label in PROFILES if label != "cpu"]
    assert sorted(DEVICE_NAMES) == sorted(gpus)  # a new profile names its card here
    for label, device in DEVICE_NAMES.items():
        reported = nvidia.NvidiaGPUAcceleratorManager._gpu_name_to_accelerator_type(device)
        assert (match_profile(device).label, PROFILES[label].ray_type, ray_type(label)) == (label, reported, reported)
    # back from a node's type (gpu=all): the label that is the type where two share it, an unknown one lower-cased
    assert [label_of_ray_type(t) for t in ("H100", "A100", "GeForce-RTX-4090", "L40S")] == ["h100", "a100", "rtx4090",
                                                                                       "l40s"]


def test_the_cpus_granted_and_torch_threads_are_recorded(monkeypatch):
    """A SLURM job or a container grants fewer CPUs than the host has: the run says what it had (issue 40: the
    same CPU configuration measured 8-27 img/s as SLURM children, 469-743 as Ray children)."""
    import torch

    from vitreg.environment import capture_environment

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    tags = capture_environment().to_tags()
    assert (tags["cpus_granted"], tags["cpus_granted_from"], tags["torch_threads"], tags["omp_threads"]) == (
        "1", "affinity", "3", "3")


@pytest.mark.parametrize("variables, mask, grant", [
    ({}, 4, (4, "affinity")),  # no scheduler: the mask
    ({"SLURM_CPUS_PER_TASK": "1", "SLURM_JOB_CPUS_PER_NODE": "2"}, 4, (1, "SLURM_CPUS_PER_TASK")),  # task/none
    ({"SLURM_JOB_CPUS_PER_NODE": "2(x3)"}, 4, (2, "SLURM_JOB_CPUS_PER_NODE")),  # --exclusive: no cpus-per-task
    ({"VITREG_RAY_TASK_CPUS": "1"}, 2, (1, "VITREG_RAY_TASK_CPUS")),  # Ray pins nothing
    ({"VITREG_RAY_TASK_CPUS": "8"}, 2, (2, "affinity")),  # the mask is narrower (a container, taskset)
    ({"SLURM_CPUS_PER_TASK": "1"}, 1, (1, "SLURM_CPUS_PER_TASK")),  # task/affinity: both agree
    ({"SLURM_CPUS_PER_TASK": "junk"}, 2, (2, "affinity")),
])
def test_fleet_iv_1_the_cpu_grant_is_the_schedulers_unless_the_affinity_mask_is_narrower(monkeypatch, variables,
                                                                                       mask, grant):
    """Issue 48, point 1: a SLURM child in a 1-CPU job recorded cpus_granted=2 (the affinity mask, which a
    scheduler without CPU binding leaves the host's). The real-cluster checks: tests/test_slurm.py, test_fleet.py."""
    from vitreg.environment import cpu_grant

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(mask)))
    assert cpu_grant(variables) == grant
