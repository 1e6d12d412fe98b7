"""benchmarks/smi_phases.py (the nvidia-smi figures of docs/benchmarks.md) on a sample whose answer is known."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "smi_phases.py"


def _load():
    spec = importlib.util.spec_from_file_location("smi_phases", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_samples_are_cut_by_vitreg_phase_and_gpu(tmp_path, capsys):
    log = tmp_path / "log.txt"
    log.write_text(
        "[10s 01:00:00] vitreg bench --model m --nproc 1 --task train --amp bf16\n"
        "train  128    2,648.6\n"
        "[40s 01:00:30]   run aaa\n"
        "[40s 01:00:30] NCCL_MAX_CTAS=8 vitreg bench --model m --nproc 2 --task train\n"
        "[90s 01:01:20]   run bbb\n"
        "[90s 01:01:20] done\n")
    rows = [  # time, gpu, SM MHz, W, throttle bits (0x4: SW power cap)
        ("00:59:59", 0, 1980, 690.0, 0x4),   # before the first phase: left out
        ("01:00:01", 0, 1920, 691.0, 0x4), ("01:00:02", 0, 1900, 692.0, 0x0), ("01:00:03", 0, 1800, 693.0, 0x4),
        ("01:00:04", 1, 345, 80.0, 0x1),     # idle GPU 1 in the 1-process phase: under 250 W, left out
        ("01:00:31", 0, 1875, 690.0, 0x4), ("01:00:31", 1, 1905, 689.0, 0x4),
        ("01:00:40", 0, 1860, 692.0, 0x4), ("01:00:40", 1, 1935, 688.0, 0x0),
        ("01:01:20", 0, 1000, 700.0, 0x4),   # the next phase's start: left out
    ]
    (tmp_path / "smi.csv").write_text("".join(
        f"2026/11/30 {t}.123, {g}, {mhz} MHz, 3201 MHz, {w} W, 40, 0x{bits:016x}\n" for t, g, mhz, w, bits in rows))
    _load().main(str(tmp_path / "smi.csv"), str(log))
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("--model m --nproc 1") and "--amp" not in out[0]
    assert out[1] == "  GPU 0:  3 samples, SM clock median 1900 MHz (min 1800), power median 692.0 W, SW power cap in 67%"
    assert out[2].startswith("NCCL_MAX_CTAS=8 --model m --nproc 2")
    assert out[3] == "  GPU 0:  2 samples, SM clock median 1868 MHz (min 1860), power median 691.0 W, SW power cap in 100%"
    assert out[4] == "  GPU 1:  2 samples, SM clock median 1920 MHz (min 1905), power median 688.5 W, SW power cap in 50%"
    assert len(out) == 5
