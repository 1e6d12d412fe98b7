"""Whole-step CUDA graphs (``cuda_graph=true``): a small model's step launches hundreds of microsecond kernels
faster than Python can queue them; a graph records the whole step once and replays it with one launch. PyTorch's
recipe ("CUDA Graphs" in the CUDA semantics notes): a capturable optimizer, autocast without its cast cache,
gradients None before the capture, warm-up and the DDP wrap on a side stream. Only GPU work replays (fixed batch,
constant learning rate, no loss read): a bench option, not a train one.
"""

from __future__ import annotations

import contextlib
import os

from vitreg.errors import VitregError, first_line

#: eager steps before the capture: DDP's runtime statistics (CUDA timers) run in its first 10
#: iterations and every 100th after; the capture, the 12th, must be none of them
EAGER_STEPS_BEFORE_CAPTURE = 11


def check_cuda_graph(amp: str, compile: str = "off", compile_backend: str = "inductor",
                     device_type: str | None = None, amp_resolved: bool = False) -> None:
    """Refuse what a whole-step CUDA graph cannot capture: the options as asked, and again once the hardware is
    known (``device_type``, the ``amp`` that ``auto`` resolved to: ``amp_resolved``)."""
    if device_type is not None and device_type != "cuda":
        raise VitregError(f"cuda_graph=true needs a CUDA GPU and this run is on {device_type}: "
                          f"pass cuda_graph=false (or run it on a GPU)")
    if amp == "fp16" and amp_resolved:
        raise VitregError("cuda_graph=true cannot capture fp16's GradScaler and amp resolved to fp16 on this GPU: "
                          "pass amp=off, or cuda_graph=false")
    if amp == "fp16":
        raise VitregError("cuda_graph=true cannot capture fp16's GradScaler (it checks for infs on the host): "
                          "use amp=bf16 or amp=off, or cuda_graph=false")
    if compile in ("reduce-overhead", "max-autotune") or compile_backend == "cudagraphs":
        what = f"compile={compile}" if compile_backend != "cudagraphs" else "compile_backend=cudagraphs"
        raise VitregError(f"cuda_graph=true and {what} both make CUDA graphs: use compile=off or compile=default "
                          f"with cuda_graph=true, or cuda_graph=false")


def require_cuda(cuda_graph: bool, device_type: str, amp: str = "off") -> None:
    """Refuse ``cuda_graph=true`` on the CPU, and with the fp16 that ``amp=auto`` resolved to."""
    if cuda_graph:
        check_cuda_graph(amp, device_type=device_type, amp_resolved=True)


def prepare_process_group() -> None:
    """Before ``init_process_group`` of a captured DDP job: NCCL's asynchronous error handling (the watchdog
    aborting communicators) does not mix with captured collectives."""
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"


@contextlib.contextmanager
def side_stream(enabled: bool):
    """Run the block on a fresh CUDA stream (DDP must be built on one before a full-backward capture)."""
    if not enabled:
        yield
        return
    import torch

    current = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(current)
    with torch.cuda.stream(side):
        yield
    current.wait_stream(side)


def capture(step, eager_steps: int = EAGER_STEPS_BEFORE_CAPTURE):
    """``step()`` ``eager_steps`` times on a side stream, one more captured and replayed once; returns the graph's
    ``replay``. ``step`` must do only GPU work on tensors that outlive the graph, gradients set to None first."""
    import torch

    with side_stream(True):
        for _ in range(eager_steps):
            step()
    # let the eager steps' collectives finish (NCCL's watchdog thread polls their events), and
    # check for capture-unsafe CUDA calls in this thread only: the watchdog's are not the step's
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            step()
    except torch.OutOfMemoryError:
        raise  # the runner's memory guard names the batch size to try
    except RuntimeError as exc:  # a host sync or an uncapturable op inside the step
        raise VitregError(f"cuda_graph=true: this step cannot be captured in a CUDA graph ({first_line(exc)}): "
                          f"pass cuda_graph=false") from exc
    graph.replay()  # the capture itself ran nothing
    return graph.replay
