"""The click type of each option in the option table: what ``--help`` shows and what shell completion offers,
never what is accepted. Each hands the text on as typed for the spec to parse, so a bad value is vitreg's
one-line ``error: ...`` (and under ``mlflow run`` the run marked FAILED); click's own checks would leave the
MLflow run RUNNING."""

from __future__ import annotations

import click
from click.shell_completion import CompletionItem

from vitreg.config.options import Option


class _AsTyped:
    """Mixed into a click type: keep its metavar, range text and completion, skip its conversion."""

    def convert(self, value, param, ctx):
        return value


class ChoiceText(_AsTyped, click.Choice):
    """``[off|bf16|fp16|auto]`` in --help; completes the choices, spelt as the table spells them (the commands'
    token normalisation is for option names, not values: ``aot_eager``)."""

    def normalize_choice(self, choice, ctx):
        return super().normalize_choice(choice, None)


#: Above this an upper bound is a machine limit (the seed's 2**63-1), not advice: --help leaves it out.
_SHOWN_MAXIMUM = 2**31


class IntText(_AsTyped, click.IntRange):
    def _describe_range(self) -> str:
        if self.max is not None and self.max >= _SHOWN_MAXIMUM:
            return f"x>={self.min}" if self.min is not None else ""
        return super()._describe_range()


class BatchText(IntText):
    """``INTEGER|auto`` and ``[x>=1]`` in --help; completes ``auto``."""

    def get_metavar(self, param, ctx=None):
        return "INTEGER|auto"

    def shell_complete(self, ctx, param, incomplete):
        from vitreg.config.options import AUTO_BATCH

        return [CompletionItem(AUTO_BATCH)] if AUTO_BATCH.startswith(incomplete.lower()) else []


class FloatText(_AsTyped, click.FloatRange):
    """``FLOAT RANGE`` and e.g. ``[0.0<=x<1.0]`` in --help."""


class FloatTextUnbounded(_AsTyped, click.types.FloatParamType):
    """``FLOAT`` in --help (no bounds to show)."""


class BoolText(_AsTyped, click.types.BoolParamType):
    """``[BOOLEAN]`` in --help (the value may be left out: ``--profile`` alone is ``--profile true``)."""

    def get_metavar(self, param, ctx=None):
        return "[BOOLEAN]"

    def shell_complete(self, ctx, param, incomplete):
        return [CompletionItem(word) for word in ("true", "false") if word.startswith(incomplete.lower())]


class GpuLabel(_AsTyped, click.types.StringParamType):
    name = "gpu"

    def shell_complete(self, ctx, param, incomplete):
        from vitreg.hardware.profiles import PROFILES

        labels = ["auto", *sorted(PROFILES)]
        return [CompletionItem(label) for label in labels if label.startswith(incomplete.lower())]


class ModelName(_AsTyped, click.types.StringParamType):
    """``MODEL`` in --help; completes the names vitreg builds, without importing timm where an earlier process
    kept them (:mod:`vitreg.models.learned_facts`: the import took 11.8 s per TAB on a loaded 2-core host)."""

    name = "model"

    def shell_complete(self, ctx, param, incomplete):
        from vitreg.models.families import all_names

        names = all_names()
        return [CompletionItem(name) for name in names if name.startswith(incomplete)]


class Text(_AsTyped, click.types.StringParamType):
    """``TEXT``: free text, completed by nothing."""


def param_type(opt: Option) -> click.ParamType:
    if opt.kind == "choice":
        return ChoiceText(opt.choices, case_sensitive=False)
    if opt.kind == "bool":
        return BoolText()
    if opt.kind in ("int", "float"):
        return _number_type(opt)
    if opt.kind == "batch":
        return BatchText(min=opt.minimum if opt.minimum is not None else 1)
    if opt.name == "gpu":
        return GpuLabel()
    if opt.name == "model" and opt.spec_field:
        return ModelName()
    return Text()


def _number_type(opt: Option) -> click.ParamType:
    upper = opt.maximum if opt.below is None else opt.below
    if opt.minimum is None and upper is None and opt.kind == "float":  # every int option has a bound
        return FloatTextUnbounded()
    return (IntText if opt.kind == "int" else FloatText)(min=opt.minimum, max=upper, max_open=opt.below is not None)
