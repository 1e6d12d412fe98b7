"""timm's own ``benchmark.py`` (benchmarks/timm_benchmark.py, copied in on the GPU machine only), run unchanged in
this process, then the peak of CUDA memory it allocated, read as vitreg reads its own: torch's counters
(``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``), in MiB. Every argument goes to timm's script.

    python benchmarks/timm_peak.py --model vit_base_patch16_224 --bench train -b 1536 --amp --amp-dtype bfloat16 \\
        --torchcompile inductor --opt adamw --no-retry

Without ``--no-retry`` timm's script retries an out-of-memory batch at a smaller one (1536 -> 1024) and prints that
batch's rate: its JSON's ``train_batch_size`` / ``infer_batch_size`` say which batch ran. Prints one JSON line last.
"""

import json
import runpy
import sys
from pathlib import Path


def main() -> None:
    import torch

    script = Path(__file__).with_name("timm_benchmark.py")
    if not script.is_file():
        sys.exit(f"{script} is missing: copy timm's benchmark.py there (see benchmarks/run.py)")
    sys.argv = [str(script), *sys.argv[1:]]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        cuda = torch.cuda.is_available()
        print(json.dumps({"check": "timm_peak", "argv": sys.argv[1:],
                          "peak_mem_allocated_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
                          "peak_mem_reserved_mb": torch.cuda.max_memory_reserved() / 2**20 if cuda else None}),
              flush=True)


if __name__ == "__main__":
    main()
