import pytest

from vitreg.errors import VitregError
from vitreg.config.spec import BenchSpec, parse_bool


def test_strings_from_mlflow_are_parsed():
    spec = BenchSpec(batch_size="32", img_size="64", warmup="3", steps="7", repeats="2", amp="BF16",
                     compile="Default", allow_gpu_mismatch="false", nproc="1")
    assert (spec.batch_size, spec.img_size, spec.warmup, spec.steps, spec.repeats) == (32, 64, 3, 7, 2)
    assert spec.amp == "bf16" and spec.compile == "default"
    assert spec.allow_gpu_mismatch is False  # bool("false") would be True: values are parsed, not truth-tested


def test_defaults_and_tasks():
    spec = BenchSpec()
    assert spec.model == "vit_base_patch16_224" and spec.compile == "off" and spec.amp == "auto"
    assert spec.tasks == ("infer", "train")
    assert BenchSpec(task="train").tasks == ("train",)


@pytest.mark.parametrize("value,expected", [("true", True), ("1", True), ("YES", True), ("off", False),
                                            ("0", False), (False, False)])
def test_parse_bool(value, expected):
    assert parse_bool(value, "x") is expected


@pytest.mark.parametrize("kwargs,needle", [
    ({"batch_size": "0"}, "batch_size=0 must be >= 1"),
    ({"batch_size": "-4"}, "batch_size=-4 must be >= 1"),
    ({"batch_size": "many"}, "is not an integer"),
    ({"amp": "bf17"}, "did you mean amp=bf16"),
    ({"compile": "max_autotune"}, "did you mean compile=max-autotune"),
    ({"task": "inference"}, "is not one of infer, train, both"),
    ({"allow_gpu_mismatch": "maybe"}, "use allow_gpu_mismatch=true or allow_gpu_mismatch=false"),
    ({"img_size": "8"}, "img_size=8 is too small"),
    ({"ddp_bucket_mb": "0"}, "ddp_bucket_mb=0 must be > 0"),
    ({"ddp_bucket_mb": "big"}, "ddp_bucket_mb='big' is not a number"),
    ({"ddp_static_graph": "sometimes"}, "use ddp_static_graph=true or ddp_static_graph=false"),
    ({"cuda_graph": "graphs"}, "use cuda_graph=true or cuda_graph=false"),
    ({"cuda_graph": "true", "amp": "fp16"}, "use amp=bf16 or amp=off, or cuda_graph=false"),
    ({"cuda_graph": "true", "compile": "reduce-overhead"}, "use compile=off or compile=default with cuda_graph=true"),
    ({"cuda_graph": "true", "compile": "default", "compile_backend": "cudagraphs"}, "compile_backend=cudagraphs both"),
])
def test_bad_values_give_one_line_errors(kwargs, needle):
    with pytest.raises(VitregError) as err:
        BenchSpec(**kwargs)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_unknown_option_suggests():
    with pytest.raises(VitregError, match="did you mean batch_size"):
        BenchSpec.from_options({"batchsize": 3})


def test_to_params_round_trip():
    spec = BenchSpec(model="deit_tiny_patch16_224", batch_size=8, allow_gpu_mismatch=True)
    params = spec.to_params()
    assert params["allow_gpu_mismatch"] == "true" and params["batch_size"] == "8"
    assert BenchSpec(**params) == spec


def test_ddp_options_parse_from_strings_for_bench_and_train():
    from vitreg.config.spec import TrainSpec

    for cls in (BenchSpec, TrainSpec):
        assert cls().ddp_options() == {"bucket_cap_mb": 25.0, "static_graph": False, "comm_hook": "none"}
        spec = cls(ddp_bucket_mb="100", ddp_static_graph="true", ddp_comm_hook="BF16")
        assert spec.ddp_options() == {"bucket_cap_mb": 100.0, "static_graph": True, "comm_hook": "bf16"}
        with pytest.raises(VitregError, match="ddp_comm_hook='int8' is not one of none, fp16, bf16"):
            cls(ddp_comm_hook="int8")


def test_cuda_graph_is_off_by_default_and_goes_with_eager_or_default_compile():
    assert BenchSpec().cuda_graph is False
    assert BenchSpec(cuda_graph="true", amp="bf16").cuda_graph is True
    assert BenchSpec(cuda_graph="true", compile="default", amp="off").to_params()["cuda_graph"] == "true"
    assert BenchSpec(cuda_graph="false", amp="fp16", compile="max-autotune").cuda_graph is False
