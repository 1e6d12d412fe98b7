"""nvidia-smi samples cut by the phases of a timestamped log: per vitreg bench command and GPU, the median SM
clock, the median power and how often the SW power-cap throttle reason was set, over the samples above 250 W
(the GPU working, not idling between phases).

    python3 benchmarks/smi_phases.py SMI_CSV LOG [LOG...]

SMI_CSV: the smi.csv that benchmarks/run.py writes beside its log.txt (several may be concatenated; timestamps keep
them apart); LOG: that log.txt, or a log of the older ddp_concurrency.sh in benchmarks/results/h200x2-2026-11-30*/.
A phase runs from its log line to the next one.
"""
from __future__ import annotations

import re
import statistics
import sys

SW_POWER_CAP = 0x4  # nvidia-smi clocks_throttle_reasons bit


def samples(path):
    """(hh:mm:ss, gpu index, SM MHz, watts, throttle bits) per nvidia-smi line."""
    for line in open(path):
        p = [x.strip() for x in line.split(",")]
        if len(p) >= 7:
            yield p[0].split()[1][:8], int(p[1]), int(p[2].split()[0]), float(p[4].split()[0]), int(p[6], 16)


def phases(path):
    """(start hh:mm:ss, what) per timestamped log line."""
    for line in open(path):
        m = re.match(r"\[\d+s (\d\d:\d\d:\d\d)\] (.*)", line)
        if m:
            yield m.group(1), m.group(2)


def main(smi, *logs):
    rows = list(samples(smi))
    gpus = sorted({r[1] for r in rows})
    for log in logs:
        marks = list(phases(log))
        for (t0, what), (t1, _) in zip(marks, marks[1:]):
            if not re.search(r"vitreg(\.cli)? bench ", what):
                continue
            print(re.sub(r" --(amp|batch-size|gpu|task) \S+| ?(\S+ -m )?vitreg(\.cli)? bench", "", what).strip()[:150])
            for gpu in gpus:
                s = [r for r in rows if t0 <= r[0] < t1 and r[1] == gpu and r[3] > 250]
                if s:
                    capped = sum(1 for r in s if r[4] & SW_POWER_CAP) / len(s)
                    print(f"  GPU {gpu}: {len(s):2d} samples, SM clock median {statistics.median(r[2] for r in s):.0f} MHz"
                          f" (min {min(r[2] for r in s)}), power median {statistics.median(r[3] for r in s):.1f} W,"
                          f" SW power cap in {capped:.0%}")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(*sys.argv[1:])
