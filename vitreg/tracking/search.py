"""Runs out of the tracking store as the tidy frame :mod:`vitreg.analysis` works on: the one place that knows
MLflow's ``search_runs()`` column names (``params.*``, ``tags.*``, ``metrics.<task>_*``) and vitreg's params
and tags in them; :func:`tidy` makes one row per (run, task) with plain columns.
"""

from __future__ import annotations

import shlex

import numpy as np
import pandas as pd

from vitreg.analysis.frame import (ALL_METRICS, CONDITION_COLUMNS, GRANT_COLUMNS, MISSING, NO_RUNS, NOT_APPLICABLE,
                                   RUN_COMMANDS, SHARED_METRICS, TASK_METRICS, CompareError, config_columns, id_columns)
from vitreg.config.options import options_of
from vitreg.console import plural
from vitreg.config.parse import param_text
from vitreg.config.spec import _TRUE, DDP_BUCKET_MB
from vitreg.errors import VitregError
from vitreg.measure.metrics import TASKS
from vitreg.tracking.delivery import HEARTBEAT_TAG
from vitreg.tracking.mlflow_on_first_use import mlflow
from vitreg.tracking.naming import gpu_text, runs_page
from vitreg.tracking.runs import SUPERSEDED_TAG, _experiments


def benchmark_runs(experiment: str) -> pd.DataFrame:
    """The experiment's benchmark runs: not its compare/check/sweep runs, nor a sweep's child a re-run replaced."""
    runs = benchmarks_only(search_runs(experiment))
    if f"tags.{SUPERSEDED_TAG}" in runs:
        runs = runs[runs[f"tags.{SUPERSEDED_TAG}"].isna()]
    return runs


def benchmarks_only(runs: pd.DataFrame) -> pd.DataFrame:
    if "tags.vitreg_job" in runs:
        runs = runs[~runs["tags.vitreg_job"].isin(["compare", "sweep", "check"])]
    return runs


#: the columns of :func:`run_list`, before each task's ``<task>_img_per_s``
RUN_LIST_COLUMNS = ("run_id", "experiment", "name", "status", "start_time", "gpu")
#: the status :func:`run_list` gives a RUNNING run no vitreg process ever reported on (no heartbeat, no vitreg
#: tag) two minutes after its start: `mlflow run` failing before the entry point leaves one RUNNING for good
NOT_VITREG = "RUNNING, not vitreg's"


def run_list(raw: pd.DataFrame) -> pd.DataFrame:
    """One row per run of ``raw`` (``newest_runs``' frame), as ``vitreg runs`` lists them: :data:`RUN_LIST_COLUMNS`,
    each task's ``<task>_img_per_s`` and ``flags`` (compare's ``suspect_masks``: the list and compare flag alike)."""
    from vitreg.analysis.comparison import suspect_masks

    if not len(raw):
        return pd.DataFrame(columns=[*RUN_LIST_COLUMNS, "flags"])
    df = raw.reset_index(drop=True)
    base = _configurations(df, _coalesce(df, "tags.source").fillna("vitreg"))
    status = _text(df, "status")
    orphan = ((status == "RUNNING") & _coalesce(df, f"tags.{HEARTBEAT_TAG}", "tags.vitreg_job").isna()
              & (pd.Timestamp.now(tz="UTC") - pd.to_datetime(base["start_time"], utc=True) > pd.Timedelta("120s")))
    status = status.mask(orphan, NOT_VITREG)
    out = pd.DataFrame({"run_id": base["run_id"], "experiment": _coalesce(df, "experiment"),
                        "name": _coalesce(df, "tags.mlflow.runName").fillna(""), "status": status,
                        "start_time": base["start_time"],
                        "gpu": [gpu_text(g, r if m else None) for g, r, m in zip(base["gpu"], base["ran_on"],
                                                                                 base["mismatch"])]})
    flags: list[list[str]] = [[] for _ in df.index]
    for task in TASKS:
        part = _task_rows(df, base, task)
        if part is None:
            continue
        out[f"{task}_img_per_s"] = part["throughput_img_per_s"]  # aligned on the run's row; NaN where not run
        for word, mask in suspect_masks(part).items():
            for row in part.index[mask]:
                flags[row] += [word] if word not in flags[row] else []
    out["flags"] = [", ".join(words) for words in flags]
    return out


def runs_frame(records) -> pd.DataFrame:
    """Records with ``params`` / ``tags`` / ``metrics`` dicts (timm imports) as a ``search_runs()``-shaped frame:
    compare an imported CSV without a tracking server."""
    rows = []
    for i, r in enumerate(records):
        row = {"run_id": f"timm-{i:05d}", "status": "FINISHED", "start_time": pd.NaT}
        row.update({f"params.{k}": v for k, v in r.params.items()})
        row.update({f"tags.{k}": v for k, v in r.tags.items()})
        row.update({f"metrics.{k}": float(v) for k, v in r.metrics.items()})
        rows.append(row)
    return pd.DataFrame(rows)


def tidy(runs_df: pd.DataFrame, axes: tuple[str, ...] = ()) -> pd.DataFrame:
    """``mlflow.search_runs()`` output as one row per (run, task) of its FINISHED runs and timm imports (others'
    numbers are partial or absent): ``run_id, start_time, source, gpu``, the configuration columns (runs that
    differ in any are never pooled; a ``task=both`` run yields a row of each), ``mismatch`` and ``ran_on`` (a
    mislabelled run: its ``mfu`` is NaN, taken against a peak of hardware that did not run it), then the task's
    metrics without their ``infer_`` / ``train_`` prefix. ``axes``: more columns to carry, each the run's tag
    of that name, else its param (``torch_version``, ...). :class:`CompareError` when nothing is left."""
    if runs_df is None or len(runs_df) == 0:
        raise CompareError(NO_RUNS)
    df, source = _finished(runs_df.reset_index(drop=True))
    base = _configurations(df, source)
    carried = [a for a in dict.fromkeys(axes) if a not in id_columns()]
    for axis in carried:
        base[axis] = _coalesce(df, f"tags.{axis}", f"params.{axis}")
    parts = [p for p in (_task_rows(df, base, task) for task in TASKS) if p is not None]
    if not parts:
        raise CompareError(
            f"the {len(df)} finished runs carry no metrics.infer_* or metrics.train_* values; "
            "check that they are vitreg benchmark runs (vitreg bench / vitreg import-timm)"
        )
    out = pd.concat(parts, ignore_index=True)
    for name in ALL_METRICS:
        if name not in out:
            out[name] = np.nan
    out.loc[out["mismatch"], "mfu"] = np.nan
    extra = [c for c in out.columns if c not in id_columns() and c not in ALL_METRICS and c not in carried]
    out = out[list(id_columns()) + carried + list(ALL_METRICS) + sorted(extra)]
    return out.sort_values(["model", "task", "gpu", "run_id"], kind="stable").reset_index(drop=True)


def _finished(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.Series]:
    status = _text(df, "status")
    if status is None:
        # A frame built by hand (or by runs_frame) may omit status; such rows are results, not in-flight runs.
        status = pd.Series("FINISHED", index=df.index, dtype=object)
    source = _coalesce(df, "tags.source").fillna("vitreg")
    keep = (status.str.upper() == "FINISHED") | (source == "timm")
    if not keep.any():
        counts = status.fillna("UNKNOWN").value_counts()
        seen = ", ".join(f"{n}x {s}" for s, n in counts.items())
        raise CompareError(
            f"none of the {len(df)} runs finished ({seen}); only FINISHED runs are compared, "
            "so re-run the failed benchmarks (their error is in the vitreg_error tag)"
        )
    return df[keep].reset_index(drop=True), source[keep].reset_index(drop=True)


def _configurations(df: pd.DataFrame, source: pd.Series) -> pd.DataFrame:
    """The identifying columns of each run (all but ``task``, which is each row's own): the GPU, then every
    configuration column, built by its entry in :data:`_BUILDERS` or, for a plain option, :func:`_option_column`."""
    base = pd.DataFrame(index=df.index)
    base["run_id"] = _text(df, "run_id") if "run_id" in df else df.index.astype(str)
    base["start_time"] = df["start_time"] if "start_time" in df else pd.NaT
    base["source"] = source
    gpu = _coalesce(df, "tags.gpu", "params.gpu")
    # params.gpu may be the request ("auto"), which says nothing about the hardware.
    gpu = gpu.where(gpu.str.lower() != "auto")
    base["gpu"] = gpu.fillna("unknown")
    jobs = _jobs(df, source)
    for column in config_columns():
        if column != "task":
            build = _BUILDERS.get(column)
            base[column] = build(df, base) if build else _option_column(df, column, jobs)
    for name in GRANT_COLUMNS:  # the CPUs and threads it ran with (vitreg.environment; <NA> before them)
        granted = _integer(df, f"tags.{name}")
        base[name] = granted.where(granted > 0, pd.NA)
    base["mismatch"], base["ran_on"] = _hardware(df, base["gpu"])
    # sweep children run side by side on a host with several GPUs: how many shared it (1 = alone; NA: not a sweep's)
    base["children_on_host"] = _integer(df, "tags.sweep_children_on_host")
    # a cluster sweep's CPU child given share_node=true ("true": other children may have run beside it on its node)
    base["on_shared_node"] = _coalesce(df, "tags.sweep_shared_node").str.lower()
    return base


def _jobs(df: pd.DataFrame, source: pd.Series) -> list[str]:
    """The command whose option defaults fill the params each run lacks (its ``vitreg_job`` tag; else ``bench``)."""
    tag = _coalesce(df, "tags.vitreg_job").str.lower()
    return [job if job in RUN_COMMANDS and src != "timm" else "bench" for job, src in zip(tag, source)]


def _option_column(df: pd.DataFrame, name: str, jobs: list[str]) -> pd.Series:
    """An identity option as a configuration column: the run's param (else its tag) as the option parses it, so
    equal settings compare equal. A run that lacks it predates the option (its command's default, what it ran
    at) or ran a command without it (:data:`NOT_APPLICABLE`)."""
    taken = {job: [o for o in options_of(job) if o.name == name] for job in set(jobs)}
    out = []
    for param, tag, job in zip(_coalesce(df, f"params.{name}"), _coalesce(df, f"tags.{name}"), jobs):
        own = taken[job]
        value = _resolved(own[0] if own else _any_option(name), param, tag)
        if isinstance(value, str):
            out.append(_canonical(own[0] if own else _any_option(name), value))
        elif own and own[0].default is not None:
            out.append(param_text(own[0].default))
        else:
            out.append(NOT_APPLICABLE if not own else MISSING)
    return pd.Series(out, index=df.index, dtype=object)


def _resolved(option, param, tag):
    """A run's param, unless missing or the option's default, which may be a request resolved later
    (``num_classes=0``): then its tag, the resolved value. ``mlflow run``'s ``0`` and a resolved ``1000`` are one."""
    if not isinstance(tag, str):
        return param
    if not isinstance(param, str) or _canonical(option, param) == param_text(option.default):
        return tag
    return param


def _any_option(name: str):
    return next(o for command in RUN_COMMANDS for o in options_of(command) if o.name == name)


def _canonical(option, value: str) -> str:
    try:
        return param_text(option.parse(value))
    except VitregError:
        return value


def _compile(df: pd.DataFrame, base: pd.DataFrame) -> pd.Series:
    """``compile`` with a backend other than the default (``default@eager``) and ``+cudagraph``."""
    mode = _coalesce(df, "params.compile", "tags.compile").fillna(MISSING)
    default = param_text(_any_option("compile_backend").default)
    backend = _coalesce(df, "params.compile_backend", "tags.compile_backend").fillna(default).str.lower()
    shown = ~mode.isin(["off", MISSING]) & (backend != default)
    compile_ = mode.where(~shown, mode.astype(str) + "@" + backend.astype(str))
    # a CUDA graph replays the same step another way: kept apart like a compile mode
    cuda_graph = _coalesce(df, "params.cuda_graph", "tags.cuda_graph").map(_is_true).astype(bool)
    return compile_.where(~cuda_graph, compile_.astype(str) + "+cudagraph")


def _img_size(df: pd.DataFrame, base: pd.DataFrame) -> pd.Series:
    # the resolved size (tag) first: params.img_size may be the request, 0 = "the model's default",
    # as a DDP launcher logs it before any rank has built the model
    img = _integer(df, "tags.img_size")
    img = img.where(img > 0, pd.NA)
    return img.fillna(_integer(df, "params.img_size"))


def _nproc(df: pd.DataFrame, base: pd.DataFrame) -> pd.Series:
    # processes in the whole job: a multi-host run's params.nproc is per host, its world_size tag is
    # what scaled (runs without the tag: nproc x nnodes, which is what the launcher starts)
    per_host = _integer(df, "params.nproc").fillna(1)
    return _integer(df, "tags.world_size").fillna(per_host * _integer(df, "params.nnodes").fillna(1))


#: configuration columns not read from one option alone (FOLDED_INTO, resolved tags, integers), in the
#: order of config_columns() (ddp reads nproc); every other configuration column is one option's value
_BUILDERS = {
    # an infer run's param is its checkpoint's architecture (model_uri folds into it: the same kernels)
    "model": lambda df, base: _coalesce(df, "params.model", "tags.model").fillna(MISSING),
    "batch_size": lambda df, base: _integer(df, "params.batch_size"),  # auto is <NA>: one configuration
    "img_size": _img_size,
    "amp": lambda df, base: _coalesce(df, "tags.amp", "params.amp").fillna(MISSING),  # resolved (auto -> bf16)
    "compile": _compile,
    "nproc": _nproc,
    "ddp": lambda df, base: _ddp_setting(df, base["nproc"]),
}


def _hardware(df: pd.DataFrame, gpu: pd.Series) -> tuple[pd.Series, pd.Series]:
    """(mislabelled?, the hardware it ran on) per run: the ``gpu_mismatch`` tag, the detected profile, and the
    device or GPU name (a CPU run under a GPU label, from runs that predate the other tags)."""
    label = gpu.astype(str).str.lower()
    flagged = _coalesce(df, "tags.gpu_mismatch").map(_is_true).astype(bool)
    detected = _coalesce(df, "tags.detected_gpu").str.lower()
    on_cpu = ((_coalesce(df, "tags.device").str.lower() == "cpu")
              | (_coalesce(df, "tags.gpu_name").str.lower() == "none"))
    ran_on = detected.where(detected.notna(), pd.Series(np.where(on_cpu, "cpu", None), index=df.index))
    mismatch = flagged | (ran_on.notna() & (ran_on != label) & (label != "unknown"))
    return mismatch.astype(bool), ran_on.astype(object).where(ran_on.notna(), np.nan)


def _task_rows(df: pd.DataFrame, base: pd.DataFrame, task: str) -> pd.DataFrame | None:
    prefix = f"metrics.{task}_"
    values = {c[len(prefix):]: pd.to_numeric(df[c], errors="coerce") for c in df.columns if c.startswith(prefix)}
    recorded = pd.DataFrame(values, index=df.index).notna().any(axis=1)
    # The task param is authoritative; without it (hand-made frames) trust the metrics.
    task_param = _coalesce(df, "params.task").str.lower()
    wanted = task_param.isin([task, "both"]).fillna(False) | (task_param.isna() & recorded)
    wanted &= recorded  # a task that logged nothing has nothing to compare
    if not wanted.any():
        return None
    part = base[wanted].copy()
    part["task"] = task
    chosen = _text(df, f"tags.{task}_batch_size_chosen")  # batch_size=auto: the batch it found
    part["batch_chosen"] = chosen[wanted] if chosen is not None else np.nan
    for name in CONDITION_COLUMNS:  # the timed windows' throttle state and host load (vitreg.measure.energy)
        tag = _text(df, f"tags.{task}_{name}")
        part[name] = tag[wanted] if tag is not None else np.nan
    for name in TASK_METRICS[task]:
        part[name] = np.nan
    for name, v in values.items():
        part[name] = v[wanted].astype(float)
    for name in SHARED_METRICS:
        col = f"metrics.{name}"
        part[name] = pd.to_numeric(df.loc[wanted, col], errors="coerce") if col in df else np.nan
    return part


def _text(df: pd.DataFrame, col: str) -> pd.Series | None:
    """The column as object-dtype strings, NaN/None/'' all None; a param as the value it stands for."""
    if col not in df:
        return None
    s = df[col].astype(object)
    s = s.where(s.notna(), None).map(lambda v: None if v is None else str(v).strip())
    if col.startswith("params."):
        s = s.map(_unquoted)
    return s.where(s.map(lambda v: bool(v)), None).astype(object)


def _unquoted(value):
    """``mlflow run`` logs an entry point's params shell-quoted (``shlex.quote`` in MLflow's
    ``EntryPoint._sanitize_value_dict``): ``''`` for an empty value, ``'a b'``. The value it stands for."""
    if not isinstance(value, str) or value[:1] != "'":
        return value
    try:
        words = shlex.split(value)
    except ValueError:
        return value
    return words[0] if len(words) == 1 and shlex.quote(words[0]) == value else value


def _coalesce(df: pd.DataFrame, *cols: str) -> pd.Series:
    out = pd.Series([None] * len(df), index=df.index, dtype=object)
    for col in cols:
        s = _text(df, col)
        if s is not None:
            out = out.where(out.notna(), s)
    return out.where(out.notna(), np.nan).astype(object)


def _is_true(value) -> bool:
    return isinstance(value, str) and value.strip().lower() in _TRUE


def _ddp_setting(df: pd.DataFrame, nproc: pd.Series) -> pd.Series:
    """The DDP settings as one string: ``-`` for one process, else ``bucket<MB>``, ``+static``, the comm hook and
    ``+NAME=VALUE`` for each NCCL variable not set alike in every multi-process run compared (``nccl_env``)."""
    bucket = pd.to_numeric(df["params.ddp_bucket_mb"], errors="coerce") if "params.ddp_bucket_mb" in df else None
    static = _text(df, "params.ddp_static_graph")
    hook = _text(df, "params.ddp_comm_hook")
    multi = [i for i in range(len(df)) if nproc.iloc[i] is not pd.NA and int(nproc.iloc[i]) > 1]
    nccl = _nccl_differences(_text(df, "tags.nccl_env"), multi)
    out = ["-"] * len(df)
    for i in multi:
        mb = bucket.iloc[i] if bucket is not None and pd.notna(bucket.iloc[i]) else DDP_BUCKET_MB
        static_on = static is not None and _is_true(static.iloc[i])
        comm = hook.iloc[i] if hook is not None else None
        out[i] = (f"bucket{mb:g}" + ("+static" if static_on else "")
                  + (f"+{comm.lower()}" if isinstance(comm, str) and comm.lower() != "none" else "")
                  + "".join(f"+{k}={v}" for k, v in nccl[i]))
    return pd.Series(out, index=df.index, dtype=object)


def _nccl_differences(tags: pd.Series | None, rows: list[int]) -> dict[int, list[tuple[str, str]]]:
    """For each of ``rows``: the ``(name, value)`` pairs of its ``nccl_env`` tag (``"K=V;K=V"``) not set alike
    in all of ``rows``, sorted."""
    texts = {i: (tags.iloc[i] if tags is not None else None) or "" for i in rows}
    env = {i: dict(kv.split("=", 1) for kv in text.split(";") if "=" in kv) for i, text in texts.items()}
    varying = {k for k in set().union(*env.values()) if len({e.get(k) for e in env.values()}) > 1}
    return {i: sorted((k, v) for k, v in e.items() if k in varying) for i, e in env.items()}


def _integer(df: pd.DataFrame, col: str) -> pd.Series:
    if col not in df:
        return pd.Series(pd.NA, index=df.index, dtype="Int64")
    return pd.to_numeric(df[col], errors="coerce").round().astype("Int64")


def experiment_links(store_uri: str, ui_url: str) -> list[str]:
    """``NAME (N runs): URL`` for each experiment of ``store_uri`` with runs, URL its runs list in the UI."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store_uri)
    links = []
    for exp in client.search_experiments():
        n = len(client.search_runs([exp.experiment_id], max_results=1000))
        if n:
            links.append(f"{exp.name} ({plural(n, 'run')}): {ui_url}/{runs_page(exp.experiment_id)}")
    return links


def print_experiment_links(store_uri: str, ui_url: str) -> None:
    links = experiment_links(store_uri, ui_url)
    print(f"MLflow UI on {ui_url} (store {store_uri}); the runs of each experiment:" if links else
          f"MLflow UI on {ui_url}: no runs in {store_uri} yet (make bench logs one); experiments: "
          f"{ui_url}/#/experiments")
    for line in links:
        print(f"  {line}")


def search_runs(experiment: str, filter_string: str = ""):
    """All runs of an experiment (by name) as a pandas DataFrame, MLflow's ``search_runs`` columns."""
    exp = _experiments(experiment)[0]
    return mlflow.search_runs(experiment_ids=[exp.experiment_id], filter_string=filter_string,
                              output_format="pandas")


def experiment_tag(experiment: str, key: str) -> str | None:
    """The experiment's tag ``key`` (None: no such experiment or tag), e.g. the team's price table."""
    exp = mlflow.MlflowClient().get_experiment_by_name(experiment)
    return None if exp is None else exp.tags.get(key)


def set_experiment_tag(experiment: str, key: str, value: str) -> None:
    """Keep ``value`` under ``key`` on the (existing) experiment, for everyone who reads it."""
    client = mlflow.MlflowClient()
    client.set_experiment_tag(client.get_experiment_by_name(experiment).experiment_id, key, value)
