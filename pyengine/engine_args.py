"""EngineConfig's settings as command-line flags and TOML keys, generated from each field's Setting
(pyengine/config.py), as vLLM derives its flags from EngineArgs: a setting's default, choices, range
and help are written once, and the server, its TOML file and the memory planner take them from there."""
from __future__ import annotations

import argparse
import functools
import types
import typing
from typing import Any, Callable, Iterable

from pyengine.config import EngineConfig, Setting, engine_settings


def flag_name(name: str) -> str:
    """max_num_seqs -> --max-num-seqs (or the Setting's own flag: speculative -> --speculative-config)."""
    return engine_settings()[name].flag or "--" + name.replace("_", "-")


def value_types(name: str) -> tuple[type, ...]:
    """The types a setting's value may have, from the field's annotation (None left out)."""
    hint = typing.get_type_hints(EngineConfig)[name]
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    return tuple(a for a in args if a is not type(None))


def default_of(name: str) -> Any:
    """The field's default value."""
    return EngineConfig.__dataclass_fields__[name].default


def _default_help(name: str, s: Setting) -> str:
    if default_of(name) is None:
        if s.default_text is None:
            raise TypeError(f"EngineConfig.{name}: a None default needs default_text to say what it means")
        return f"(default: {s.default_text})".replace("%", "%%")
    return "(default: %(default)s)"


def add_engine_arguments(parser: argparse.ArgumentParser, names: Iterable[str],
                         extra_choices: dict[str, dict[str, str]] | None = None) -> None:
    """Add the flags of the settings `names` to `parser`, one argument group per Setting.group
    ("engine: KV cache"), each flag's dest the field's name. extra_choices: per setting, choices this
    program takes beyond the field's and what each means (the planner's --kv-cache-dtype all)."""
    settings = engine_settings()
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name in names:
        s = settings[name]
        if s.group not in groups:
            groups[s.group] = parser.add_argument_group(f"engine: {s.group}")
        extra = (extra_choices or {}).get(name, {})
        help_text = ("cuda only: " if s.cuda_only else "") + s.help.replace("%", "%%")
        help_text += "".join(f"; {choice}: {meaning}" for choice, meaning in extra.items())
        kwargs: dict[str, Any] = dict(dest=name, default=default_of(name),
                                      help=f"{help_text} {_default_help(name, s)}")
        kinds = value_types(name)
        if kinds == (bool,):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif s.parse is not None:
            kwargs["type"] = _argument_type(s.parse)
            kwargs["metavar"] = "JSON" if s.example and s.example.startswith("{") else None
        elif len(kinds) == 1:
            kwargs["type"] = kinds[0]
        else:
            raise TypeError(f"EngineConfig.{name}: a value of several types ({kinds}) needs a Setting.parse")
        if s.choices is not None:
            kwargs["choices"] = [*s.choices, *extra]
        groups[s.group].add_argument(flag_name(name), **kwargs)


@functools.cache
def _argument_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """parse as an argparse type: its ValueError's message shown, not argparse's "invalid value" (one
    wrapper per parse function, so parsers built from the same settings take the same types)."""
    def checked(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    checked.__name__ = getattr(parse, "__name__", "value")
    return checked


def engine_fields(args: argparse.Namespace, names: Iterable[str]) -> dict[str, Any]:
    """The values of the settings `names` in parsed arguments."""
    return {name: getattr(args, name) for name in names}


def toml_types(names: Iterable[str]) -> dict[str, tuple[type, ...]]:
    """The TOML value types each setting takes: its own, and strings where it parses them (sizes)."""
    return {name: value_types(name) + ((str,) if engine_settings()[name].parse else ()) for name in names}


def from_toml(name: str, value: Any) -> Any:
    """A setting's TOML value as the field takes it ("64MiB" -> bytes); argparse.ArgumentTypeError
    or ValueError where a string does not parse."""
    parse = engine_settings()[name].parse
    return parse(value) if parse is not None and isinstance(value, str) else value
