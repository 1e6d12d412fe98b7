"""--help shows each option's type, choices and bounds from the option table; shell completion completes
their values; and the click types still accept any text, so the spec's one-line errors stay the only
validation (tests/test_bench_e2e.py::test_bad_input_exit_2_and_failed_run checks those end to end)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.shell_completion import ShellComplete
from click.testing import CliRunner

from vitreg.cli.main import main
from vitreg.config.options import AMP_CHOICES, COMMANDS, options_of

SHOWN = {"int": "INTEGER", "float": "FLOAT", "bool": "BOOLEAN"}


def command_of(name: str) -> click.Command:
    return main.commands[name]


def help_records(name: str) -> dict[str, tuple[str, str]]:
    cmd = command_of(name)
    ctx = click.Context(cmd, info_name=name)
    return {p.name: p.get_help_record(ctx) for p in cmd.params if isinstance(p, click.Option)}


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_every_option_s_kind_and_choices(command):
    records = help_records(command)
    for opt in options_of(command):
        flags, text = records[opt.name]
        if opt.kind == "choice":
            assert flags.endswith(f" [{'|'.join(opt.choices)}]"), flags
        elif opt.kind in SHOWN:
            assert SHOWN[opt.kind] in flags and "TEXT" not in flags, flags
        if opt.minimum is not None:
            assert f"x>={opt.minimum}" in text or f"{opt.minimum}<=x" in text, (opt.name, text)


def test_help_text_as_printed():
    out = CliRunner().invoke(main, ["train", "--help"], terminal_width=200).output
    assert "--amp [auto|off|tf32|bf16|fp16]" in out
    assert "--batch-size INTEGER RANGE" in out and "[default: 64; x>=1]" in out
    assert "--allow-gpu-mismatch [BOOLEAN]" in out  # the value may be left out: a bare flag is true
    assert "0.0<=x<1.0" in out  # label_smoothing: below 1, exclusive
    assert "--gpu GPU" in out and "--model MODEL" in out
    assert "--experiment TEXT" in out
    assert "x>=0]" in out and "9223372036854775807" not in out  # the seed: no 19-digit machine limit
    bench = CliRunner().invoke(main, ["bench", "--help"], terminal_width=200).output
    assert "--batch-size INTEGER|auto" in bench and "[default: auto; x>=1]" in bench
    assert re.search(r"--task \[infer\|train\|both\] +What to time", bench)  # the choices once, then the meaning


def all_commands(group: click.Group = main, prefix: tuple = ()) -> list[tuple[str, ...]]:
    found = []
    for name, cmd in group.commands.items():
        found.append((*prefix, name))
        if isinstance(cmd, click.Group):
            found += all_commands(cmd, (*prefix, name))
    return found


def option_lines(path: tuple[str, ...]) -> list[list[str]]:
    """Every option section of ``vitreg <path> --help`` as printed (after the command's text), one word list
    per option line."""
    out = CliRunner().invoke(main, [*path, "--help"], terminal_width=200).output
    sections = out.split("\n\n", 2)[2]  # after the usage line and the command's own text
    return [line.split() for line in sections.splitlines() if line.startswith("  -")]


def command_at(path: tuple[str, ...]) -> click.Command:
    cmd = main
    for name in path:
        cmd = cmd.commands[name]
    return cmd


@pytest.mark.parametrize("path", all_commands(), ids="-".join)
def test_help_lists_each_option_once_with_its_type(path):
    lines = option_lines(path)
    firsts = [words[0] for words in lines]
    assert not [words for words in lines if words[0].endswith(",")], lines  # one spelling a line
    for param in command_at(path).params:
        if not isinstance(param, click.Option) or param.hidden:
            continue
        shown = getattr(param, "shown", param.opts[0])  # sweep's --axis: the one-axis spelling
        assert firsts.count(shown) == 1, (param.opts, firsts)
        assert not (set(param.opts + param.secondary_opts) - {shown}) & set(firsts), (param.opts, firsts)
        words = lines[firsts.index(shown)]
        if not param.is_flag:  # a value option: its type follows the flag
            assert len(words) > 1 and (words[1].split("|")[0].isupper() or words[1].startswith("[")), words
    for opt in options_of(path[-1]) if path[-1] in COMMANDS else ():
        if opt.kind != "str":  # a number, a bool, a batch size or a choice never reads as free text
            assert lines[firsts.index(opt.help_flag or opt.flags[0])][1] != "TEXT", (opt.name, opt.kind)


def test_help_sentences_start_with_a_capital_unless_they_open_with_a_name():
    for path in all_commands():
        for param in command_at(path).params:
            first = (param.help or "X").split(" ", 1)[0] if isinstance(param, click.Option) else "X"
            if first.rstrip(":,.;").isalpha() and first != "timm":
                assert first[0].isupper(), (path, param.opts, param.help)


@pytest.mark.parametrize("command,required", [("bench", []), ("train", []), ("infer", ["--model-uri", "m"]),
                                              ("sweep", ["--models", "test_vit"])])
def test_experiment_takes_mlflow_run_s_spelling_too(command, required):
    ctx = command_of(command).make_context(command, ["--experiment-name", "laptop", *required])
    assert ctx.params["experiment"] == "laptop"


def completions(args: list[str], incomplete: str) -> list[str]:
    complete = ShellComplete(main, {}, "vitreg", "_VITREG_COMPLETE")
    return [item.value for item in complete.get_completions(args, incomplete)]


@pytest.mark.parametrize("args,incomplete,expected", [
    (["bench", "--amp"], "", list(AMP_CHOICES)),
    (["bench", "--amp"], "b", ["bf16", "bf16-weights"]),
    (["train", "--compile"], "reduce", ["reduce-overhead"]),
    (["train", "--distillation"], "", ["none", "soft", "hard"]),
    (["bench", "--cuda-graph"], "", ["true", "false"]),
    (["infer", "--allow_gpu_mismatch"], "F", ["false"]),
    (["bench", "--gpu"], "h1", ["h100", "h100-pcie"]),
    (["bench", "--gpu"], "a", ["auto", "a100", "a100-80gb"]),
    (["bench", "--model"], "torchvision:vit_b", ["torchvision:vit_b_16", "torchvision:vit_b_32"]),
])
def test_completion_offers_the_values(args, incomplete, expected):
    assert completions(args, incomplete) == expected


def test_completion_of_model_names_comes_from_timm():
    names = completions(["train", "--model"], "deit_t")
    assert "deit_tiny_patch16_224" in names and "deit_tiny_distilled_patch16_224" in names
    assert all(n.startswith("deit_t") for n in names)


@pytest.mark.slow
def test_completion_script_as_the_readme_sources_it():
    vitreg = Path(sys.executable).parent / "vitreg"
    for shell, needle in (("bash", "complete -o nosort -F"), ("zsh", "compdef"), ("fish", "complete --no-files")):
        proc = subprocess.run([str(vitreg)], env={"_VITREG_COMPLETE": f"{shell}_source", "PATH": "/usr/bin:/bin",
                                                  **({"PYTHONPATH": str(Path(__file__).parent.parent)})},
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and needle in proc.stdout, (shell, proc.stdout[:300], proc.stderr[-300:])
    proc = subprocess.run([str(vitreg)], env={"_VITREG_COMPLETE": "bash_complete", "COMP_WORDS": "vitreg bench --amp ",
                                              "COMP_CWORD": "3", "PYTHONPATH": str(Path(__file__).parent.parent)},
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == [f"plain,{c}" for c in AMP_CHOICES], proc.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_click_types_hand_any_text_on_unchanged(command):
    # the spec parses every value: click must not (its usage error would leave an MLflow run RUNNING)
    cmd = command_of(command)
    ctx = click.Context(cmd, info_name=command)
    for param in cmd.params:
        for text in ("fp8", "-3", "many", "1e9", "perhaps", ""):
            assert param.type.convert(text, param, ctx) == text, (param.name, text)
