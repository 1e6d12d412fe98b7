"""The option table (vitreg/config/options.py) is the one truth: MLproject, the click commands, the specs'
fields and parsing, and the README's parameter tables all come from it and agree with it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from vitreg.config import generate, options
from vitreg.config.options import COMMANDS, KINDS, OPTIONS, options_of, spec_options
from vitreg.config.parse import options_to_args
from vitreg.config.spec import BenchSpec, TrainSpec
from vitreg.errors import VitregError

REPO = Path(__file__).resolve().parent.parent
SPECS = {"bench": BenchSpec, "train": TrainSpec}


def click_command(name):
    from vitreg.cli.main import main

    return main.commands[name]


def test_generated_files_are_up_to_date():
    """MLproject and the README tables hold exactly what `make mlproject` writes from the table."""
    for path, text in generate.generated_files(REPO).items():
        assert path.read_text() == text, f"{path.name} is out of date: run `make mlproject`"
    assert generate.main(["--check"]) == 0


def test_generated_files_follow_the_table(monkeypatch):
    changed = [dataclasses.replace(o, default=12) if o.name == "warmup" else o for o in OPTIONS]
    monkeypatch.setattr(options, "OPTIONS", tuple(changed))
    assert 'warmup: {type: string, default: "12"}' in generate.mlproject_text()
    assert "| `warmup` | `12` |" in generate.readme_table("bench")
    readme = REPO / "README.md"
    assert generate.generated_files(REPO)[readme] != readme.read_text()


def test_table_is_well_formed():
    for o in OPTIONS:
        assert o.kind in KINDS and o.commands and set(o.commands) <= set(COMMANDS), o
        assert o.help and "|" not in o.meaning, o
        if o.kind == "choice":
            assert o.default in o.choices, o
        if o.default is not None:
            # the text MLflow and click hold means the default (a runtime_env's: none, {})
            assert o.parse(o.default_text) == (o.default if o.kind != "runtime_env" else {}), o
    for command in COMMANDS:
        names = [o.name for o in options_of(command)]
        assert len(names) == len(set(names)), f"{command} takes two options of one name"


@pytest.mark.parametrize("command", COMMANDS)
def test_click_options_are_the_table(command):
    params = {p.name: p for p in click_command(command).params if p.name != "help"}
    assert set(params) == {o.name for o in options_of(command)}
    for o in options_of(command):
        param = params[o.name]
        assert set(o.flags) == set(param.opts), o.name  # both spellings, --batch-size and --batch_size
        assert param.required == (o.required and not o.unless), o.name  # "unless": checked by check_first
        if o.repeatable:  # a flag given several times (sweep's --axis): click holds a list of texts
            assert param.multiple and param.default == ([o.default_text] if o.default_text else []), o.name
        elif not o.required:
            assert param.default == (o.default_text if o.default is not None else None), o.name
        assert param.envvar == o.envvar, o.name


@pytest.mark.parametrize("command", COMMANDS)
def test_mlproject_entry_points_are_the_table(command):
    entry = yaml.safe_load((REPO / "MLproject").read_text())["entry_points"][command]
    wanted = [o for o in options_of(command) if o.mlproject]
    assert set(entry["parameters"]) == {o.name for o in wanted}
    assert entry["command"].split()[:2] == ["python", f"entry_points/{command}.py"]
    assert (REPO / "entry_points" / f"{command}.py").exists()
    for o in wanted:
        param = entry["parameters"][o.name]
        assert param["type"] == "string", o.name
        if o.default is None:
            assert "default" not in param, o.name
        else:
            assert param["default"] == o.default_text, o.name  # a string: YAML must not read "off" as False
        assert f"{o.flags[0]} {{{o.name}}}" in entry["command"], o.name


@pytest.mark.parametrize("command", ["bench", "train"])
def test_spec_fields_are_the_table(command):
    cls = SPECS[command]
    table = spec_options(command)
    assert [f.name for f in dataclasses.fields(cls)] == [o.name for o in table]
    for f, o in zip(dataclasses.fields(cls), table):
        assert f.default == o.default, o.name
    assert cls(**{o.name: o.default_text for o in table}) == cls()  # -P defaults parse to the defaults


@pytest.mark.parametrize("command", ["bench", "train"])
def test_spec_parses_each_field_by_its_kind_and_bounds(command):
    """Not a parse_* call per field: each field refuses what its option's kind, choices or minimum refuse."""
    cls = SPECS[command]
    for o in spec_options(command):
        bad = {"int": "1.5", "float": "x", "bool": "maybe", "choice": "nonsense"}.get(o.kind)
        if bad is None:
            continue
        with pytest.raises(VitregError, match=re.escape(f"{o.name}={bad!r}")):
            cls(**{o.name: bad})
        if o.kind == "int" and o.minimum is not None:
            with pytest.raises(VitregError, match=f"{o.name}={int(o.minimum) - 1} must be >= {int(o.minimum)}"):
                cls(**{o.name: str(int(o.minimum) - 1)})


def _readme_rows(command: str) -> dict[str, str]:
    text = (REPO / "README.md").read_text()
    block = text.split(f"<!-- options:{command} -->")[1].split(f"<!-- /options:{command} -->")[0]
    rows = {}
    for line in block.strip().splitlines()[2:]:
        names, default = line.split(" | ")[:2]
        for name in re.findall(r"`(\w+)`", names):
            rows[name] = default
    return rows


@pytest.mark.parametrize("command", ["bench", "train"])
def test_readme_tables_are_the_table(command):
    rows = _readme_rows(command)
    params = [o for o in options_of(command) if o.mlproject]
    assert set(rows) == {o.name for o in params}
    for o in params:
        if command == "bench" or "bench" not in o.commands:
            assert rows[o.name] == (f"`{o.default_text}`" if o.default_text else '`""`'), o.name
        else:
            assert rows[o.name] == "as in bench", o.name  # the same option as bench's


def test_options_to_args_round_trips_through_train_click():
    from click.testing import CliRunner
    import click

    from vitreg.cli.common import command_options

    seen = {}

    @click.command()
    @command_options("train")
    def cmd(**kwargs):
        seen.update(kwargs)

    sent = {"model": "test_vit", "steps": 3, "lr": 1e-3, "ddp_static_graph": True, "resume": None}
    result = CliRunner().invoke(cmd, options_to_args(sent))
    assert result.exit_code == 0, result.output
    assert (seen["model"], seen["steps"], seen["lr"], seen["ddp_static_graph"]) == ("test_vit", "3", "0.001", "true")
    assert seen["resume"] == ""  # None: not passed, the default applies
    assert TrainSpec.from_options({k: seen[k] for k in seen if k in {o.name for o in spec_options("train")}}).lr == 1e-3


def test_every_option_says_whether_it_changes_the_work():
    """Each option is identity (changes the work measured) or says why runs differing in it measure the same work."""
    for o in OPTIONS:
        assert o.identity != bool(o.same_work), f"{o.name} ({o.commands}): identity=True, or a same_work reason"
    assert {"model", "sdpa", "compile_backend", "cuda_graph", "nproc"} <= set(options.identity_names("bench"))
    assert "seed" not in options.identity_names("bench") and "gpu" not in options.identity_names("bench")
