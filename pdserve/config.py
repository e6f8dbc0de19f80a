"""One configuration schema for flags, environment variables and a YAML file.

Each setting is a dataclass field. It becomes the flag ``--field-name``, the environment
variable ``PDSERVE_FIELD_NAME`` and the YAML key ``field_name``; the first of flag > env >
file > default that is set wins. Values are validated by the dataclasses themselves.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from pathlib import Path
from typing import Any, Mapping

import yaml

ENV_PREFIX = "PDSERVE_"


def setting(
    default: Any, help: str, *, choices: tuple | None = None, short: str | None = None, secret: bool = False
) -> Any:
    """``secret``: its value is never repeated in a message or printed."""
    return dataclasses.field(
        default=default, metadata={"help": help, "choices": choices, "short": short, "secret": secret}
    )


def choices_of(cls: type, name: str) -> tuple:
    """The allowed values of setting ``name`` of ``cls`` (for tools that take the same option)."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    return tuple(field.metadata["choices"])


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(cls: type, field: dataclasses.Field) -> type:
    hint = typing.get_type_hints(cls)[field.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def add_arguments(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Adds a flag per field; flag defaults are None so unset flags fall through to env/file."""
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        kind = _base_type(cls, field)
        names = [_flag(field.name)] + ([field.metadata["short"]] if field.metadata.get("short") else [])
        help_text = f"{field.metadata.get('help', '')} (default: {field.default}; env {ENV_PREFIX}{field.name.upper()})"
        if kind is bool:
            parser.add_argument(
                *names, dest=field.name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            parser.add_argument(
                *names,
                dest=field.name,
                default=None,
                help=help_text,
                type=kind if kind in (int, float) else str,
                choices=field.metadata.get("choices"),
            )


def _coerce(kind: type, value: Any, source: str, secret: bool = False) -> Any:
    if (
        value is None or isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    ):  # YAML's true is no 1
        return value
    if isinstance(value, (list, dict)):
        shown = "" if secret else f": {value!r}"
        raise ValueError(f"{source}: expected one {kind.__name__}, got a YAML {type(value).__name__}{shown}")
    text = str(value).strip()
    try:
        if kind is bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        return kind(text)
    except ValueError:
        shown = "its value" if secret else repr(value)
        raise ValueError(f"{source}: {shown} is not a valid {kind.__name__}") from None


class _TextLoader(yaml.SafeLoader):
    """YAML whose scalars stay the text they were written as (null aside), so a file's value is
    read like an environment variable's: an unquoted 012345 token is not octal 5349, 1.10 not 1.1."""


_TextLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag == "tag:yaml.org,2002:null"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def load_file(path: str | Path | None) -> dict[str, Any]:
    if not path:
        return {}
    try:
        data = yaml.load(Path(path).read_text(encoding="utf-8"), Loader=_TextLoader)
    except OSError as e:
        raise ValueError(f"config file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"config file {path} is not UTF-8 text (byte {e.start})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"config file {path} is not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    if data is None:  # an empty file
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of settings")
    keys = [key for key in data if not isinstance(key, str)]
    if keys:
        raise ValueError(f"config file {path}: {keys[0]!r} is not a setting name")
    return data


def resolve(
    cls: type,
    args: argparse.Namespace | None,
    env: Mapping[str, str] | None = None,
    file: Mapping[str, Any] | None = None,
    **fixed: Any,
):
    """Builds ``cls`` from flag > env > file > default; ``fixed`` values override everything."""
    env = os.environ if env is None else env
    file = file or {}
    values = dict(fixed)
    for field in dataclasses.fields(cls):
        if field.name in fixed:
            continue
        kind = _base_type(cls, field)
        env_name = ENV_PREFIX + field.name.upper()
        flag_value = getattr(args, field.name, None) if args is not None else None
        secret = field.metadata.get("secret", False)
        if flag_value is not None:
            values[field.name] = flag_value
        elif env.get(env_name, "") != "":
            values[field.name] = _coerce(kind, env[env_name], env_name, secret)
        elif file.get(field.name) is not None:  # YAML's null: not set
            values[field.name] = _coerce(kind, file[field.name], f"config file key {field.name}", secret)
        choices = field.metadata.get("choices")
        if choices and field.name in values and values[field.name] not in choices:
            raise ValueError(f"{field.name} must be one of {', '.join(map(str, choices))}, got {values[field.name]!r}")
    return cls(**values)


def unknown_file_keys(file: Mapping[str, Any], *classes: type) -> list[str]:
    known = {f.name for cls in classes for f in dataclasses.fields(cls)}
    return sorted(set(file) - known)


def to_args(obj: Any) -> list[str]:
    """Flags that reproduce ``obj``'s non-default settings (for starting child processes)."""
    args: list[str] = []
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if value == field.default or value is None:
            continue
        if isinstance(value, bool):
            args.append(_flag(field.name) if value else "--no-" + field.name.replace("_", "-"))
        else:
            args.append(f"{_flag(field.name)}={value}")  # one word: a value may start with "-"
    return args


def env_names(*settings: Any) -> set[str]:
    """The environment variables that set these settings (dataclass instances or classes)."""
    return {ENV_PREFIX + field.name.upper() for obj in settings for field in dataclasses.fields(obj)}
