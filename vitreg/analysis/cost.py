"""Which GPU is cheapest per image, and which gives the most images per joule, with compare's verdicts.

Prices per GPU-hour come from the user (vitreg ships none): ``--prices h200=3.50,l4=0.80`` or a CSV or TOML
file. A run's ``usd_per_1m_img`` = price x GPUs / 3600 / img/s x 1e6; it and ``img_per_j`` are compared as any
metric and said in a sentence per GPU, with what the runs' timed windows met (:func:`condition_lines`).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from vitreg.analysis.comparison import SHARED_HOST, Comparison, compare_runs, suspect_masks
from vitreg.analysis.frame import DEFAULT_AXIS, GRANT_COLUMNS, CompareError
from vitreg.analysis.render import cell
from vitreg.analysis.stats import BETTER, WORSE
from vitreg.console import plural
from vitreg.files import read_text, read_toml
from vitreg.measure.energy import POWER_CAP, SPREAD_LIMIT

COST, ENERGY = "usd_per_1m_img", "img_per_j"
#: USD per GPU-hour: far above any GPU's rent, and far below where a cost per image overflows to inf
MAX_PRICE = 1e6
#: the price table's text (:func:`price_text`) as an experiment tag: MLflow keeps at most 20,000 characters
MAX_PRICES_CHARS = 20000
NO_PRICE = ("no price per GPU-hour, so no cost per image: add one with --prices h200=3.50,l4=0.80 (USD per "
            "GPU-hour by GPU label, or a CSV/TOML file); compare keeps it in the experiment for the team")


def parse_prices(text: str) -> dict[str, float]:
    """``"h200=3.50,l4=0.80"`` or the path of a price file -> ``{label: usd_per_hour}`` (labels lower-case)."""
    text = (text or "").strip()
    if not text:
        return {}
    prices = read_price_file(text) if "=" not in text else {
        label.strip().lower(): _price(value, f"--prices {pair.strip()!r}") if sep else _bad(pair)
        for pair in text.split(",") for label, sep, value in [pair.partition("=")]}
    if len(price_text(prices)) > MAX_PRICES_CHARS:  # refused before any work, not by the store at the end
        raise CompareError(f"--prices holds {len(prices)} prices, {len(price_text(prices))} characters as "
                           f"label=price pairs, over the {MAX_PRICES_CHARS} the experiment's "
                           f"prices tag keeps: pass only the GPU labels of the runs compared")
    return prices


def _bad(pair: str):
    raise CompareError(f"--prices {pair.strip()!r} is not LABEL=USD_PER_HOUR: pass e.g. --prices h200=3.50,l4=0.80")


def _price(value, where: str) -> float:
    try:
        price = float(str(value).strip().lstrip("$"))
    except ValueError:
        price = math.nan
    if not math.isfinite(price) or price <= 0:
        raise CompareError(f"{where}: {value!r} is not a positive price in USD per GPU-hour (e.g. 3.50)")
    if price > MAX_PRICE:  # a price near float's limit gives an infinite cost per image, not a ranking
        raise CompareError(f"{where}: {price:g} USD per GPU-hour is over {MAX_PRICE:,.0f}, the most a price may "
                           f"be (its cost per image must stay finite): give it in USD per GPU-hour (e.g. 3.50)")
    return price


PRICE_FILE_FIX = "pass a CSV (gpu,usd_per_hour) or TOML (h200 = 3.50) price table, or LABEL=USD pairs"


def read_price_file(path) -> dict[str, float]:
    """A CSV (``gpu,usd_per_hour``) or TOML (``label = price``, flat or under ``[usd_per_gpu_hour]``) price table."""
    path = Path(path)
    if not path.is_file():
        raise CompareError(f"--prices {str(path)!r}: no such file; pass LABEL=USD pairs (h200=3.50,l4=0.80) or the "
                           "path of a CSV (gpu,usd_per_hour) or TOML (h200 = 3.50) price table")
    if path.suffix == ".toml":
        table = read_toml(path, PRICE_FILE_FIX, CompareError)
        table = table.get("usd_per_gpu_hour", table)
        return {str(k).lower(): _price(v, f"{path}: {k}") for k, v in table.items()}
    rows = list(csv.DictReader(read_text(path, PRICE_FILE_FIX, CompareError).splitlines()))
    if not rows or not {"gpu", "usd_per_hour"} <= set(rows[0]):
        raise CompareError(f"{path}: a price CSV needs the columns gpu,usd_per_hour (one GPU label a row)")
    return {r["gpu"].strip().lower(): _price(r["usd_per_hour"], f"{path}: {r['gpu']}") for r in rows}


def price_text(prices: dict[str, float]) -> str:
    """The canonical ``label=price,...`` form (what the experiment keeps, and --prices takes back)."""
    return ",".join(f"{label}={price:g}" for label, price in sorted(prices.items()))


def with_costs(runs: pd.DataFrame, prices: dict[str, float]) -> pd.DataFrame:
    """The tidy frame with ``usd_per_1m_img`` for every run whose GPU label has a price (NaN elsewhere)."""
    price = runs["gpu"].astype(str).str.lower().map(prices).astype(float)
    gpus = pd.to_numeric(runs["nproc"], errors="coerce").fillna(1).astype(float)
    rate = pd.to_numeric(runs["throughput_img_per_s"], errors="coerce").where(lambda r: r > 0)
    return runs.assign(**{COST: price * gpus / 3600 / rate * 1e6})


@dataclass
class EnergyAndCost:
    comparisons: dict = field(default_factory=dict)  # metric -> Comparison
    lines: list = field(default_factory=list)


def energy_and_cost(runs: pd.DataFrame, prices: dict[str, float], baseline: str | None, by: str = DEFAULT_AXIS,
                    include_mismatch: bool = False) -> EnergyAndCost:
    """Compare images per joule (where runs logged it) and, with ``prices``, USD per million images, against
    ``baseline`` where it has such runs."""
    out = EnergyAndCost(lines=condition_lines(runs))
    frames = {ENERGY: runs}
    if prices:
        frames[COST] = with_costs(runs, prices)
    for metric, frame in frames.items():
        measured = frame[frame[metric].notna()]
        if measured.empty:
            continue
        base = baseline if baseline and (measured[by].astype(str).str.lower() == baseline.lower()).any() else None
        comparison = compare_runs(frame, base, metric, by=by, include_mismatch=include_mismatch)
        out.comparisons[metric] = comparison
        out.lines += sentences(comparison)
    if not prices:
        out.lines.append(NO_PRICE)
    elif COST not in out.comparisons:
        out.lines.append(f"no run of a priced GPU ({', '.join(sorted(prices))}) recorded its throughput")
    return out


# how a factor x (> 1: better than the baseline) reads, and one value, per metric
_SAY = {COST: (lambda x: f"is {x:.2f}x cheaper per image than" if x >= 1 else f"is {1 / x:.2f}x dearer per image than",
               "$ {v:,.4g} per 1M images"),
        ENERGY: (lambda x: f"gives {x:.2f}x the images per joule of", "{v:,.2f} img/J")}
_VERDICT = {COST: {BETTER: "cheaper", WORSE: "dearer"}, ENERGY: {BETTER: "more efficient", WORSE: "less efficient"}}


def sentences(c: Comparison) -> list[str]:
    """One sentence per (configuration, GPU) compared with the baseline: "on vit_base_patch16_224 infer (batch
    256), the l4 is 2.30x cheaper per image than the h200 ($ 0.04 per 1M images), 95 % interval [2.10, 2.52]x:
    cheaper". The interval is of the factor as said (cheaper or dearer)."""
    metric, lines = c.metric, []
    said, value = _SAY[metric]
    for _, r in c.table.iterrows():
        what = f"{r['model']} {r['task']} (batch {cell(r['batch_size'])})"
        shown = value.format(v=r[f"{metric}_median"])
        if not c.baseline or r["verdict"] == "baseline" or not np.isfinite(r["speedup"]):
            lines.append(f"on {what}, the {r[c.by]}: {shown}" + (f" ({r['verdict']})" if c.baseline else ""))
            continue
        lo, hi = r["ci_low"], r["ci_high"]
        if metric == COST and r["speedup"] < 1:  # said as "dearer": the interval of that factor, 1/x
            lo, hi = 1 / hi, 1 / lo
        ci = f", {c.confidence:.0%} interval [{lo:.2f}, {hi:.2f}]x" if np.isfinite(lo) else ""
        verdict = _VERDICT[metric].get(r["verdict"], r["verdict"])
        lines.append(f"on {what}, the {r[c.by]} {said(r['speedup'])} the {c.baseline} ({shown}){ci}: {verdict}")
    return lines


def condition_lines(runs: pd.DataFrame) -> list[str]:
    """What the runs' timed windows met: a throttle state all share said once (the software power cap is heavy
    work's normal state on an H200), one that differs between GPUs marked, the runs of every suspect flag named."""
    lines = []
    seen = runs.dropna(subset=["throttle"]) if "throttle" in runs else runs.iloc[0:0]
    states = sorted(set(seen["throttle"].astype(str)))
    if len(states) == 1:
        cap = " (the software power cap: heavy work's normal state on e.g. an H200)" if states[0] == POWER_CAP else ""
        lines.append(f"every run's timed windows met throttle: {states[0]}{cap}")
    elif states:
        per = seen.groupby("gpu")["throttle"].agg(lambda s: "/".join(sorted(set(s.astype(str)))))
        lines.append("THROTTLE DIFFERS between the runs compared: " + ", ".join(f"{g}: {t}" for g, t in per.items()))
    suspect = suspect_masks(runs)
    hot = runs[suspect["throttled"]]
    if len(hot):
        lines.append(f"THROTTLED by heat or a hardware brake: {len(hot)} run(s): "
                     + ", ".join(f"{r.run_id} ({r.gpu}: {r.throttle})" for r in hot.itertuples()))
    for flag, said in (("busy host", "BUSY HOST: {} run(s) measured while other processes loaded the host (their "
                                      "figures may be low)"),
                       (SHARED_HOST, "SHARED HOST: {} run(s) timed while other children of their sweep ran on "
                                     "their host (sweep_children_on_host; their figures may be low)"),
                       ("wide spread", f"SPREAD: {{}} run(s) whose window spread was over {SPREAD_LIMIT:.0%} (the "
                                       "windows' CV)"),
                       ("eager fp8", "EAGER FP8: {} run(s) ran fp8 without compile, about half of bf16's speed on an "
                                     "H200 (--compile default fuses the quantize steps)")):
        ids = sorted(set(runs.loc[suspect[flag], "run_id"]))
        if ids:
            lines.append(said.format(len(ids)) + ": " + ", ".join(ids))
    return lines + grant_lines(runs)


def grant_lines(runs: pd.DataFrame) -> list[str]:
    """One line when the runs compared were granted different CPUs or torch threads (their rows are kept apart:
    a CPU figure moves 20-90x with them): each grant and how many runs had it."""
    if any(c not in runs for c in GRANT_COLUMNS):
        return []
    grants = runs.drop_duplicates("run_id")[list(GRANT_COLUMNS)].astype(object)
    said = grants.apply(lambda r: "/".join("-" if pd.isna(v) else str(int(v)) for v in r), axis=1)
    if said.nunique() < 2:
        return []
    counts = said.value_counts().sort_index()
    return ["CPU GRANTS DIFFER (cpus/threads; rows kept apart): "
            + ", ".join(f"{g}: {plural(n, 'run')}" for g, n in counts.items())]

