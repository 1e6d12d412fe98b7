"""Text -> typed value, with a one-line error naming the fix: the parsers of every vitreg option. A bool is
parsed from its text, never its truthiness (``bool("false")`` is True); ``error`` lets a caller raise its own
:class:`VitregError` subclass (the tracking server's ``ServerError``).
"""

from __future__ import annotations

import difflib
import json
import os

from vitreg.errors import VitregError

TRUE = ("1", "true", "yes", "on", "y", "t")
FALSE = ("0", "false", "no", "off", "n", "f", "")
AUTO_BATCH = "auto"  # batch_size=auto: the runner searches the batch (vitreg.measure.autobatch)
#: how alike (difflib's ratio) a mistyped option name must be to a real one to be suggested, without the dashes:
#: click's 0.6, with them, offered `--nnodes` and `--profile` for `--modle`
NAME_CUTOFF = 0.7


def close_names(typed: str, known, n: int = 1) -> list[str]:
    """The names of ``known`` alike enough to ``typed`` to suggest, the closest first, then those it abbreviates
    (``--batch``: ``--batch-size``)."""
    bare = {name.lstrip("-"): name for name in known}
    word = typed.lstrip("-")
    alike = difflib.get_close_matches(word, list(bare), n=n, cutoff=NAME_CUTOFF)
    begun = [name for name in bare if len(word) >= 3 and name.startswith(word) and name not in alike]
    return [bare[m] for m in (alike + begun)[:n]]


def parse_bool(value, name: str, error: type[VitregError] = VitregError) -> bool:
    """``"true"``/``"false"`` (and 1/0, yes/no, on/off) -> bool."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in TRUE:
        return True
    if text in FALSE:
        return False
    raise error(f"{name}={value!r} is not a boolean: use {name}=true or {name}=false")


def parse_int(value, name: str, minimum: int | None = None, maximum: int | None = None,
              error: type[VitregError] = VitregError) -> int:
    """An integer from a string or an int, at least ``minimum`` (and, given, at most ``maximum``)."""
    ranged = f"set it to a number from {minimum} to {maximum}" if maximum is not None else None
    try:
        number = int(str(value).strip())
    except ValueError:
        raise error(f"{name}={value!r} is not an integer; {ranged or f'pass e.g. {name}=64'}") from None
    if ranged and not minimum <= number <= maximum:
        raise error(f"{name}={number} is out of range; {ranged}")
    if minimum is not None and number < minimum:
        raise error(f"{name}={number} must be >= {minimum}: pass e.g. {name}={max(minimum, 1)}")
    return number


def parse_float(value, name: str, minimum: float | None = None, maximum: float | None = None,
                below: float | None = None) -> float:
    """A finite float from a string or a number, with bounds (``below`` is exclusive)."""
    try:
        number = float(str(value).strip())
    except ValueError:
        raise VitregError(f"{name}={value!r} is not a number: pass e.g. {name}=0.1") from None
    if number != number or number in (float("inf"), float("-inf")):
        raise VitregError(f"{name}={value!r} must be a finite number")
    if minimum is not None and number < minimum:
        raise VitregError(f"{name}={number:g} must be >= {minimum:g}")
    if maximum is not None and number > maximum:
        raise VitregError(f"{name}={number:g} must be <= {maximum:g}")
    if below is not None and number >= below:
        raise VitregError(f"{name}={number:g} must be < {below:g}")
    return number


def parse_choice(value, name: str, choices: tuple[str, ...]) -> str:
    """A value from a fixed set (case-insensitive); a near miss gets a suggestion."""
    text = str(value).strip().lower()
    if text in choices:
        return text
    close = difflib.get_close_matches(text, choices, n=1)
    hint = f" (did you mean {name}={close[0]}?)" if close else ""
    raise VitregError(f"{name}={value!r} is not one of {', '.join(choices)}{hint}")


def parse_batch(value, name: str):
    """``"auto"`` (any case) -> :data:`AUTO_BATCH`, else an int >= 1."""
    text = str(value).strip().lower()
    if text == AUTO_BATCH:
        return AUTO_BATCH
    if not text.lstrip("+-").isdigit():
        raise VitregError(f"{name}={value!r} is not an integer or auto: pass e.g. {name}=64, or {name}=auto "
                          f"(search the fastest batch that fits)")
    return parse_int(text, name, 1)


def param_text(value) -> str:
    """A value as an MLflow param or a command-line word: booleans as true/false."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def options_to_args(options: dict) -> list[str]:
    """``{"batch_size": "64"}`` -> ``["--batch-size", "64"]`` (None skipped): the argv of a child vitreg process."""
    args = []
    for key, value in options.items():
        if value is not None:
            args += [f"--{key.replace('_', '-')}", param_text(value)]
    return args


#: Ray's runtime_env fields (ray.runtime_env.RuntimeEnv.known_fields; a plugin may add more: warned, not refused)
RAY_ENV_FIELDS = ("conda", "config", "container", "env_vars", "excludes", "image_uri", "java_jars", "pip",
                  "py_executable", "py_modules", "uv", "worker_process_setup_hook", "working_dir")
RUNTIME_ENV_MAX = 2000  # characters: a sweep's parent records it whole in a tag (8,000) beside its other settings
_warned: set = set()


def parse_runtime_env(text, name: str = "ray_runtime_env") -> dict:
    """A Ray runtime_env from its JSON, quoted in no message: its ``env_vars`` values are secrets, masked in every
    line and record from here on (:func:`vitreg.console.add_secrets`); one recorded masked (:func:`masked_runtime_env`)
    is taken from this process's environment variable of that name, or refused."""
    from vitreg.console import MASK, add_secrets, progress
    from vitreg.files import parse_json

    text = str(text or "").strip()
    fix = f"pass a JSON object of Ray's runtime_env fields, e.g. {name}='{{\"pip\": [\"timm\"]}}'"
    if len(text) > RUNTIME_ENV_MAX:
        raise VitregError(f"{name} is {len(text):,} characters, over {RUNTIME_ENV_MAX:,} (the sweep records it): "
                          f"list the packages in a requirements file and pass {{\"pip\": \"/path/requirements.txt\"}}")
    try:
        env = parse_json(text or "{}")
    except ValueError as exc:  # FileFault: not JSON, too deep, a NUL; its words quote none of the text
        raise VitregError(f"{name}: {exc}: {fix}") from None
    env_vars = env.get("env_vars", {}) if isinstance(env, dict) else None
    if not isinstance(env_vars, dict) or not all(isinstance(v, str) for v in env_vars.values()):
        raise VitregError(f"{name} must be a JSON object whose env_vars (if any) maps names to strings: {fix}")
    add_secrets(env_vars.values())
    missing = [key for key, value in env_vars.items() if value == MASK and not os.environ.get(key)]
    if missing:
        raise VitregError(f"{name}'s env_vars {', '.join(missing)} were not recorded (secrets): export "
                          f"{missing[0]}=... here, or pass {name} again in full")
    if env_vars:
        env["env_vars"] = {key: os.environ[key] if value == MASK else value for key, value in env_vars.items()}
        add_secrets(env["env_vars"].values())
    for field in sorted(set(env) - set(RAY_ENV_FIELDS) - _warned):
        _warned.add(field)
        close = [f" (did you mean {c!r}?)" for c in close_names(field, RAY_ENV_FIELDS)]
        progress(f"warning: {name} has a field Ray does not know, {field!r}{''.join(close)}")
    return env


def masked_runtime_env(settings: dict) -> dict:
    """A sweep's settings as its parent records them: each ``env_vars`` value of ``ray_runtime_env`` masked, as
    :func:`parse_runtime_env` reads it back."""
    from vitreg.console import MASK

    env = json.loads(str(settings.get("ray_runtime_env") or "").strip() or "{}")
    env.update({"env_vars": dict.fromkeys(env["env_vars"], MASK)} if env.get("env_vars") else {})
    return {**settings, **({"ray_runtime_env": json.dumps(env, separators=(",", ":"))} if env else {})}
