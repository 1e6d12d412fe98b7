"""Run a Python module as ``python -m`` would, with AOTAutograd's activation memory budget set first
(``torch._functorch.config.activation_memory_budget``, which has no environment variable): below 1, the partitioner
of a compiled training step saves fewer activations for the backward and recomputes them there. A screen of the
lever (issue 46) on an unchanged vitreg, whose bench runs in this process:

    python benchmarks/with_budget.py 0.7 vitreg.cli bench --model vit_base_patch16_224 --task train --amp bf16 \\
        --compile default --batch-size 1536
"""

import runpy
import sys


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    import torch._functorch.config as functorch_config

    functorch_config.activation_memory_budget = float(sys.argv[1])
    sys.argv = sys.argv[2:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
