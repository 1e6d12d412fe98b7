"""What the ``vitreg`` commands and the Python API share: the click options from the option table, one-line
user errors, the launcher's own options of the DDP jobs, and the command a user typed, as report.md shows it."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shlex
import signal
import sys
from pathlib import PurePath

import click
from click.core import ParameterSource

from vitreg.cli.param_types import param_type
from vitreg.config.options import HELP_GROUPS, help_group, option, options_of
from vitreg.config.parse import close_names, param_text
from vitreg.errors import VitregError
from vitreg.environment import environ_restored
from vitreg.signals import Terminated
from vitreg.console import VERBOSE_ENV, scrub


class OneSpelling(click.Option):
    """An option whose --help line shows one flag (``--batch-size``, or ``shown``: sweep's ``--axis``); the
    others stay accepted (``mlflow run`` passes an undeclared ``-P batch_size=8`` as ``--batch_size 8``).
    ``group``: the --help section it is listed in (:class:`VitregCommand`)."""

    def __init__(self, *args, shown: str | None = None, group: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.shown = shown or self.opts[0]
        self.group = group

    def get_help_record(self, ctx):
        spellings, self.opts = self.opts, [self.shown]
        try:
            return super().get_help_record(ctx)
        finally:
            self.opts = spellings


def dashed(token: str) -> str:
    """click's token_normalize_func: ``--batch_size`` is ``--batch-size``, ``import_timm`` is ``import-timm``."""
    return token.replace("_", "-")


class OneLineUsageError(click.UsageError):
    """click's usage error as vitreg prints every bad input: one ``error:`` line naming the fix, exit 2."""

    def show(self, file=None) -> None:
        # `vitreg bench --help`, also where the command ran as an MLproject entry point (`-P k=v` are its options)
        where = f"`vitreg {self.ctx.info_name} --help`" if self.ctx and self.ctx.parent else "`vitreg --help`"
        click.echo(f"error: {scrub(self.format_message()).rstrip('.')}; see {where}", err=True)


class VitregCommand(click.Command):
    """A command whose --help lists its options in sections (:data:`vitreg.config.options.HELP_GROUPS`) and whose
    usage errors are one line, suggesting only spellings --help shows. (click-option-group and rich-click would
    be a dependency for what ``format_options`` does: the option table already names each option's section.)
    """

    def format_options(self, ctx, formatter) -> None:
        sections: dict[str, list] = {title: [] for title, _ in HELP_GROUPS}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                sections.setdefault(getattr(param, "group", None) or "Options", []).append(record)
        for title, records in sections.items():
            if not records:
                continue
            with formatter.section(title):
                formatter.write_dl(records)

    def spellings(self, ctx) -> dict[str, str]:
        """Every accepted spelling of each option (``--batch_size``, ``--experiment-name``) -> the one --help shows."""
        return {flag: p.shown if isinstance(p, OneSpelling) else p.opts[0]
                for p in self.get_params(ctx) if isinstance(p, click.Option) and not p.hidden for flag in p.opts}

    def shell_complete(self, ctx, incomplete):
        items = super().shell_complete(ctx, incomplete)
        shown = set(self.spellings(ctx).values())
        return [item for item in items if not item.value.startswith("-") or item.value in shown]

    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as exc:
            spellings = self.spellings(ctx)  # a spelling close to the typo suggests the option as --help shows it
            close = list(dict.fromkeys(spellings[name] for name in close_names(exc.option_name, spellings, n=3)))
            hint = f" (did you mean {' or '.join(close)}?)" if close else ""
            raise OneLineUsageError(f"no such option {exc.option_name}{hint}", ctx) from None
        except click.UsageError as exc:
            raise OneLineUsageError(exc.format_message(), ctx) from None


def sentence(text: str) -> str:
    """Help with a capital first letter, as click writes it (not where it opens with a name: ``timm``, ``vit_*``)."""
    first = text.split(" ", 1)[0]
    if not text or first == "timm" or not first.rstrip(":,.;").isalpha():
        return text
    return text[0].upper() + text[1:]


def command_options(command: str):
    """Decorator: every option of ``command`` in the option table, as click options. Values stay strings, parsed
    by the spec, so ``--flag false`` and ``-P flag=false`` mean the same; a boolean's value may be left out."""

    def decorate(fn):
        for opt in reversed(options_of(command)):
            if opt.required:  # with ``unless``, checked in check_first: click knows no "unless"
                settings = {"required": not opt.unless}
            else:
                settings = {"default": opt.default_text if opt.default is not None else None,
                            "show_default": bool(opt.default_text)}
            if opt.repeatable:
                settings = {"multiple": True, "default": [opt.default_text] if opt.default_text else []}
            if opt.kind == "bool":
                settings.update(is_flag=False, flag_value="true")  # a value option whose value may be left out
            fn = click.option(*opt.flags, opt.name, cls=OneSpelling, type=param_type(opt), help=sentence(opt.help),
                              envvar=opt.envvar, shown=opt.help_flag, group=help_group(command, opt.name),
                              **settings)(fn)
        return fn

    return decorate


def split_options(command: str, values: dict) -> tuple[dict, dict]:
    """A command's values as (the spec's fields, the command's own options), both by name; a name of no option
    goes with the fields, for the spec to refuse."""
    own = {o.name for o in options_of(command) if not o.spec_field}
    return ({k: v for k, v in values.items() if k not in own}, {k: v for k, v in values.items() if k in own})


def check_first(command: str, values: dict) -> None:
    """Refuse a bad option value of a job before any heavy import (torch, timm, mlflow: 5-10 s) and before any
    run exists. What needs the model built or the device stays the job's check, inside its run."""
    from vitreg.hardware.profiles import check_label_here
    from vitreg.models.families import check_name

    for opt in options_of(command):
        if opt.required and opt.unless and values.get(opt.name) is None and not values.get(opt.unless):
            raise OneLineUsageError(f"Missing option '{opt.flags[0]}'", click.get_current_context())
        if values.get(opt.name) is not None and not opt.repeatable:
            opt.parse(values[opt.name])
    fields, own = split_options(command, values)
    if command == "sweep":
        from vitreg.bench.sweep import check_options

        check_options(own, fields)
        return
    from vitreg.config.spec import BenchSpec, TrainSpec

    spec = (TrainSpec if command == "train" else BenchSpec).from_options(
        {**fields, "model": "pending"} if command == "infer" else fields)  # infer's model: the checkpoint's, later
    if command in JOB_OPTIONS:
        launcher_options(command, own)
        check_name(spec.model)
    check_label_here(spec.gpu, spec.device, spec.allow_gpu_mismatch)
    server_first(command, own)


def server_first(command: str, own: dict) -> None:
    """A tracking server that does not answer is said before the job's heavy imports, in the run's own words
    (:func:`vitreg.tracking.store.check_server`); only in the process that opens the run (not offline, not a
    torchrun rank, not a node other than the first)."""
    from vitreg.ddp.world import inside_torchrun

    if inside_torchrun() or _own_value(command, own, "node_rank"):
        return
    from vitreg.tracking.spool import offline_mode
    from vitreg.tracking.store import check_server

    if not offline_mode(_own_value(command, own, "offline")):  # the option or VITREG_OFFLINE=1
        check_server()  # it reads the URI without importing mlflow (~2 s of CPU) where nothing has


def store_first(source: str) -> None:
    """A checkpoint in a SQL server store (``models:/``, ``runs:/`` with a PostgreSQL or MySQL tracking URI) that
    refuses connections is said before the command's heavy imports (mlflow, SQLAlchemy, torch); an HTTP server's
    failure is said as the download meets it (check_server's advice to log offline is a job's, not a pull's)."""
    if str(source).strip().startswith(("models:/", "runs:/")):
        from vitreg.tracking.store import check_sql_server
        from vitreg.tracking.uris import current_uri

        check_sql_server(current_uri())


#: Each DDP job's own keyword arguments besides the placement: options the launcher uses and does not forward
JOB_OPTIONS = {"bench": ("baseline_run",), "train": ()}


def launcher_options(command: str, own: dict) -> dict:
    """The launcher's own options of a DDP job, parsed, as keyword arguments of ``bench()`` and ``train()``."""
    from vitreg.ddp.launcher import Placement, check_nodes

    placement = Placement(*(_own_value(command, own, name) for name in ("nnodes", "node_rank", "rdzv_endpoint")))
    check_nodes(placement.nnodes, placement.node_rank, placement.rdzv_endpoint)  # also for one process
    return {"placement": placement, **{name: _own_value(command, own, name) for name in JOB_OPTIONS[command]}}


def _own_value(command: str, own: dict, name: str):
    value = option(command, name).parse(own[name]) if own.get(name) is not None else None
    return value.strip() or None if isinstance(value, str) else value


def run_ddp_job(command: str, job, values: dict) -> None:
    options, own = split_options(command, values)
    with offline_if_asked(command, own):
        job(options, experiment=own["experiment"], run_name=own["run_name"],
            command=command_line(click.get_current_context()), **launcher_options(command, own))


@contextlib.contextmanager
def offline_if_asked(command: str, own: dict):
    """``offline=true`` and ``verbose=true`` as ``VITREG_OFFLINE=1`` and ``VITREG_VERBOSE=1`` (the torchrun ranks
    inherit them) for the length of the command."""
    asked = {env: "1" for env, name in (("VITREG_OFFLINE", "offline"), (VERBOSE_ENV, "verbose"))
             if option(command, name).parse(own[name])}
    with environ_restored(*asked):
        os.environ.update(asked)
        yield


def user_errors(fn):
    """A VitregError as one ``error:`` line and exit 2, the run ``mlflow run`` opened marked FAILED."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except VitregError as exc:
            from vitreg.ddp.diagnose import record_error
            from vitreg.ddp.world import is_main_process
            from vitreg.tracking import runs as tracking

            if is_main_process():  # under torchrun every rank sees mlflow run's run id: rank 0 ends it
                tracking.fail_requested_run(str(exc))
            record_error(str(exc), exc.exit_code)  # in a torchrun worker: the launcher's root cause
            click.echo(f"error: {scrub(as_typed(str(exc)))}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt as exc:  # a stop signal: the run, if one was open, has ended (tracked_run)
            stopped(exc)
        except Exception as exc:  # a tracking store failure no layer turned into one line: do it here
            from vitreg.tracking.store import store_error_for

            error = store_error_for(exc)
            if error is None:
                raise
            click.echo(f"error: {scrub(str(error))}", err=True)
            sys.exit(error.exit_code)

    return wrapper


_ADVICE = re.compile(r"(?:e\.g\.|did you mean) ")
_SETTING = re.compile(r"\b([a-z][a-z0-9_]*)=('[^']*'|[^\s,;)?]*[^\s,;)?.:])")


def as_typed(message: str) -> str:
    """A fix a message advises (after ``e.g.``, ``did you mean``) in the spelling typed: ``--batch-size 1`` on the
    command line; ``batch_size=1`` (``-P``'s, the API's) elsewhere. The option's flag is the one --help shows."""
    ctx = click.get_current_context(silent=True)
    advice = _ADVICE.search(message)
    if ctx is None or advice is None or _entry_point(ctx):
        return message
    flags = {o.name: o.help_flag or o.flags[0] for o in options_of(ctx.info_name)}
    spelled = _SETTING.sub(lambda m: f"{flags[m[1]]} {m[2]}" if m[1] in flags else m[0], message[advice.end():])
    return message[:advice.end()] + spelled


def stopped(exc: KeyboardInterrupt) -> None:
    """The one line of a command stopped by a signal, saying where its run ended, and exit 128 + N as a shell's
    (130 for Ctrl-C, not click's ``Aborted!`` and 1)."""
    from vitreg import signals

    signum = exc.signum if isinstance(exc, Terminated) else signal.SIGINT
    where = f"; {signals.run_ends[-1]}" if signals.run_ends else ""
    ctx = click.get_current_context(silent=True)
    if where and ctx is not None and _entry_point(ctx):  # an MLproject entry point: `mlflow run`'s child
        # MLflow 3's `mlflow run` then sets FAILED on every run whose command did not exit 0, whatever the
        # run's status (its _maybe_set_run_terminated compares the status string with RunStatus' integers)
        where += ", then `mlflow run` marks it FAILED (as it does every run whose command did not exit 0)"
    click.echo(f"error: {signals.interrupted_reason(exc)}{where}", err=True)
    sys.exit(128 + signum)


def _entry_point(ctx: click.Context) -> str | None:
    prog = PurePath(ctx.find_root().info_name or "vitreg")
    return prog.stem if prog.parent.name == ENTRY_POINTS_DIR else None


# ---------------------------------------------------------------- the command typed

ENTRY_POINTS_DIR = "entry_points"  # the MLproject scripts call the CLI with prog_name="entry_points/<name>.py"


def command_line(ctx: click.Context) -> str:
    """``mlflow run . -e bench -P model=deit_tiny_patch16_224`` or ``vitreg bench --model deit_tiny_patch16_224``.
    Under ``mlflow run`` the process sees every param, defaults included: only those that differ are said."""
    command = ctx.info_name
    if _entry_point(ctx):
        return _mlflow_run(_entry_point(ctx), ctx.params)
    given = [o for o in options_of(command) if ctx.get_parameter_source(o.name) in
             (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT) and ctx.params.get(o.name) is not None]
    words = ["vitreg", command]
    for o in given:
        words += [o.flags[0], param_text(ctx.params[o.name])]
    return shlex.join(words)


def _env_manager_local() -> bool:
    """True outside an environment ``mlflow run`` built (its conda envs ``mlflow-<hash>``, its ``~/.mlflow/envs``)."""
    conda = os.environ.get("CONDA_DEFAULT_ENV", "")
    return not conda.startswith("mlflow-") and f"{os.sep}.mlflow{os.sep}envs{os.sep}" not in sys.prefix


def _mlflow_run(entry_point: str, values: dict) -> str:
    words = ["mlflow", "run", ".", "-e", entry_point] + (["--env-manager", "local"] if _env_manager_local() else [])
    for o in options_of(entry_point):
        value = values.get(o.name)
        if o.mlproject and value is not None and param_text(value) != o.default_text:
            words += ["-P", f"{o.name}={param_text(value)}"]
    return shlex.join(words)
