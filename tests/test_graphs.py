"""vitreg.measure.graphs on a CPU: what can run without CUDA (the refusals, the side-stream no-op, the error a failed
capture turns into). The capture itself runs on the GPU only (docs/benchmarks.md has its H200 runs)."""

import contextlib

import pytest

from vitreg.measure import graphs
from vitreg.errors import VitregError


def test_require_cuda_refuses_cpu_and_resolved_fp16_and_passes_otherwise():
    graphs.require_cuda(False, "cpu", "fp16")  # off: nothing to check
    graphs.require_cuda(True, "cuda", "bf16")
    with pytest.raises(VitregError, match="needs a CUDA GPU and this run is on cpu: pass cuda_graph=false"):
        graphs.require_cuda(True, "cpu")
    with pytest.raises(VitregError, match="amp resolved to fp16 on this GPU: pass amp=off, or cuda_graph=false"):
        graphs.require_cuda(True, "cuda", "fp16")


def test_side_stream_off_is_a_plain_block():
    ran = []
    with graphs.side_stream(False):
        ran.append(1)
    assert ran == [1]


def test_a_step_that_cannot_be_captured_is_a_one_line_error(monkeypatch):
    import torch

    class FakeGraph:
        def replay(self):  # pragma: no cover - never reached
            raise AssertionError

    @contextlib.contextmanager
    def failing_capture(graph, **kwargs):
        assert kwargs == {"capture_error_mode": "thread_local"}
        yield
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(graphs, "side_stream", lambda enabled: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", failing_capture)
    calls = []
    with pytest.raises(VitregError) as err:
        graphs.capture(lambda: calls.append(1), eager_steps=3)
    assert calls == [1, 1, 1, 1]  # three eager steps, then the one under capture
    msg = str(err.value)
    assert "operation not permitted when stream is capturing" in msg and msg.endswith("pass cuda_graph=false")
    assert "\n" not in msg
