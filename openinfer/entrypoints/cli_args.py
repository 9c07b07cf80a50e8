"""The engine's command-line flags, generated from `EngineConfig`'s fields (their type, default and help): one
declaration per setting, as vLLM's `EngineArgs`.

A field `max_num_seqs` is `--max-num-seqs`; a bool field is a pair (`--enforce-eager` / `--no-enforce-eager`), and
giving both halves of a pair (or a flag and its alias with other values) is refused by name, never settled by
order. A field whose flag a subcommand already uses for something else (`generate --seed` is the sampling seed)
is `--engine-<name>` there. Fields with `cli=False` in their metadata have no flag (`worker_authkey`: a secret
does not belong on a command line).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing

from openinfer.config import EngineConfig

_SCALARS = (int, float, str)


def engine_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(EngineConfig) if f.metadata.get("cli", True)]


def _scalar_type(field: dataclasses.Field):
    """The field's type for argparse: int / float / str (Optional unwrapped); None for bools."""
    hint = typing.get_type_hints(EngineConfig)[field.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)] if isinstance(
        hint, types.UnionType) or typing.get_origin(hint) is typing.Union else [hint]
    if args == [bool]:
        return None
    return next((a for a in args if a in _SCALARS), str)


class _Once(argparse.Action):
    """Stores a value; a second flag of the same setting with another value is an error naming both."""

    def __init__(self, *args, const_value=None, **kwargs):
        self.const_value = const_value
        super().__init__(*args, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        value = self.const_value if self.nargs == 0 else values
        seen = getattr(namespace, "_engine_flags_seen", None)
        if seen is None:
            seen = {}
            setattr(namespace, "_engine_flags_seen", seen)
        if self.dest in seen and seen[self.dest][1] != value:
            parser.error(f"{seen[self.dest][0]} and {option_string} contradict each other")
        seen[self.dest] = (option_string, value)
        setattr(namespace, self.dest, value)


def add_engine_args(parser: argparse.ArgumentParser, taken: set[str] = frozenset()) -> None:
    """Every engine flag into `parser` (one group); `taken`: flags the subcommand uses itself."""
    g = parser.add_argument_group("engine (EngineConfig)")
    for f in engine_fields():
        flag = "--" + f.name.replace("_", "-")
        if flag in taken:
            flag = "--engine-" + f.name.replace("_", "-")
        aliases = [a for a in f.metadata.get("aliases", ()) if a not in taken]
        help_text = f.metadata.get("help", "")
        kind = _scalar_type(f)
        if kind is None:      # a bool: --x / --no-x (an alias starting with --no- means False)
            no_flag = "--no-" + flag[2:]
            default = "default: on" if f.default is True else "default: off" if f.default is False else \
                "default: chosen by the engine"
            g.add_argument(flag, *[a for a in aliases if not a.startswith("--no-")], dest=f.name, action=_Once,
                           nargs=0, const_value=True, default=f.default, help=f"{help_text} ({default})")
            g.add_argument(no_flag, *[a for a in aliases if a.startswith("--no-")], dest=f.name, action=_Once,
                           nargs=0, const_value=False, default=f.default, help=argparse.SUPPRESS)
            continue
        kwargs = dict(dest=f.name, action=_Once, default=f.default, help=help_text)
        if f.metadata.get("json"):
            kwargs["type"] = _json_value(flag)
        else:
            kwargs["type"] = kind
        for key in ("choices", "metavar"):
            if key in f.metadata:
                kwargs[key] = f.metadata[key]
        g.add_argument(flag, *aliases, **kwargs)


def _json_value(flag: str):
    def parse(text: str):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{flag} takes JSON: {e}") from None
    parse.__name__ = "JSON"
    return parse


def engine_options(args: argparse.Namespace) -> dict:
    """The EngineConfig keyword arguments the parsed flags hold (every field, defaults included)."""
    return {f.name: getattr(args, f.name) for f in engine_fields()}


def as_flags(args: argparse.Namespace) -> list[str]:
    """The engine options of `args` that differ from their defaults, as command-line flags again (to start a
    server process with the same engine)."""
    flags = []
    for f in engine_fields():
        value = getattr(args, f.name)
        if value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif f.metadata.get("json"):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags
