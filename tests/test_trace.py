"""profile=true: a Chrome trace and a top-ops table of steady-state steps, and its refusal with cuda_graph."""

import gzip
import json

import pytest
import torch

from vitreg.errors import VitregError
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


def test_profile_with_cuda_graph_is_refused_in_one_line():
    with pytest.raises(VitregError) as err:
        check_profile_request(profile=True, cuda_graph=True)
    assert "use cuda_graph=false to profile" in str(err.value) and "\n" not in str(err.value)
    check_profile_request(profile=True, cuda_graph=False)
    check_profile_request(profile=False, cuda_graph=True)
