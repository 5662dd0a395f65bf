"""Command-line flags and the configuration reference, generated from a config tree.

A flag's name, type, choices, help and default all come from the dataclass field it sets
(`configuration.fields`). Flags that are not given stay out of the namespace, so a config
built from it keeps its dataclasses' own defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import MISSING, dataclass
from typing import Any, Callable, Literal, Union

from configuration.fields import ABSENT, FLAG, HELP, HIDDEN, PARSE, PREFIX, SHOWN, TITLE
from configuration.parsers import parse_bytes, parse_json_object

_SEP = "__"  # joins a field's path into its argparse dest
_METAVARS: dict[Any, str] = {int: "N", float: "X", str: "TEXT", parse_bytes: "SIZE", parse_json_object: "JSON"}


@dataclass(frozen=True, slots=True)
class Flag:
    path: tuple[str, ...]  # field names from the root config
    name: str  # without the leading "--"
    help: str
    section: str
    default: Any  # as the dataclass writes it (MISSING: required)
    parse: Callable[[str], Any] | None
    choices: tuple[Any, ...] | None = None
    boolean: bool = False
    many: bool = False  # a tuple: one or more values
    shown: str | None = None  # the default in words, where it depends on the host
    required: bool = False  # no default, and not in an optional section: the command needs it

    @property
    def dest(self) -> str:
        return _SEP.join(self.path)

    @property
    def shown_default(self) -> str:
        if self.shown is not None:
            return self.shown
        if self.required:
            return "required"
        if self.default is MISSING:
            return "unset"
        if self.default is None:
            return "unset"
        if isinstance(self.default, tuple):
            return " ".join(map(str, self.default)) or "none"
        return str(self.default)


def _optional_inner(hint: Any) -> tuple[Any, bool]:
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return hint, False


def _default(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def tree_flags(
    cls: type, prefix: str = "", path: tuple[str, ...] = (), title: str = "", optional: bool = False
) -> list[Flag]:
    """Every flag of the tree rooted at `cls`, in field order; `optional`: under an optional section."""
    hints = typing.get_type_hints(cls)
    out: list[Flag] = []
    for f in dataclasses.fields(cls):
        if f.metadata.get(HIDDEN) or HELP not in f.metadata:
            continue
        hint, is_optional = _optional_inner(hints[f.name])
        if TITLE in f.metadata:
            here = optional or is_optional
            out += tree_flags(hint, prefix + f.metadata[PREFIX], (*path, f.name), f.metadata[TITLE], here)
            continue
        name = prefix + (f.metadata[FLAG] or f.name.replace("_", "-"))
        flag = dict(
            path=(*path, f.name),
            name=name,
            help=f.metadata[HELP],
            section=title,
            default=_default(f),
            shown=f.metadata.get(SHOWN),
            # In an optional section a field without default is needed only with the others.
            required=_default(f) is MISSING and not optional,
        )
        parse = f.metadata[PARSE]
        if parse is not None:
            out.append(Flag(**flag, parse=parse))
        elif hint is bool:
            out.append(Flag(**flag, parse=None, boolean=True))
        elif typing.get_origin(hint) is Literal:
            choices = typing.get_args(hint)
            out.append(Flag(**flag, parse=type(choices[0]), choices=choices))
        elif typing.get_origin(hint) is tuple:
            out.append(Flag(**flag, parse=typing.get_args(hint)[0], many=True))
        elif hint in (int, float, str):
            out.append(Flag(**flag, parse=hint))
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: give the knob a parse= for {hint!r}, or hide it")
    return out


def add_flags(parser: argparse.ArgumentParser, cls: type, skip: frozenset[str] = frozenset()) -> list[Flag]:
    """Flags for every knob of `cls`'s tree (by section), except the flag names in `skip`."""
    flags = [flag for flag in tree_flags(cls) if flag.name not in skip]
    groups: dict[str, Any] = {}
    for flag in flags:
        group = groups.get(flag.section)
        if group is None:
            group = groups[flag.section] = parser.add_argument_group(flag.section) if flag.section else parser
        said = "unset:" in flag.help and flag.default is None  # the help already says what unset means
        default = "required" if flag.required else f"default: {flag.shown_default}"
        text = flag.help if said else f"{flag.help} ({default})"
        kwargs: dict[str, Any] = {
            "dest": flag.dest,
            "default": argparse.SUPPRESS,
            "help": text.replace("%", "%%"),
            "required": flag.required,
        }
        if flag.boolean:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = flag.parse
            if flag.choices:
                kwargs["choices"] = flag.choices
            else:
                kwargs["metavar"] = _METAVARS.get(flag.parse, "VALUE")
            if flag.many:
                kwargs["nargs"] = "+"
        group.add_argument(f"--{flag.name}", **kwargs)
    return flags


def set_flag_defaults(parser: argparse.ArgumentParser, cls: type, defaults: dict[str, Any]) -> None:
    """Another default for some flags of this parser (by flag name, e.g. "device"), for a tool
    that runs the same tree in another setting (the GPU smoke test)."""
    dests = {flag.name: flag.dest for flag in tree_flags(cls)}
    parser.set_defaults(**{dests[name]: value for name, value in defaults.items()})


def build(cls: type, namespace: argparse.Namespace, path: tuple[str, ...] = (), prefix: str = "") -> Any:
    """An instance of `cls` from the flags given; every other field keeps its default."""
    given = vars(namespace)
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    missing: list[str] = []
    for f in dataclasses.fields(cls):
        here, key = (*path, f.name), _SEP.join((*path, f.name))
        if TITLE in f.metadata:
            inner, optional = _optional_inner(hints[f.name])
            if optional and not any(k.startswith(key + _SEP) for k in given):
                continue  # an optional section none of whose flags was given stays None
            kwargs[f.name] = build(inner, namespace, here, prefix + f.metadata[PREFIX])
        elif key in given:
            value = given[key]
            kwargs[f.name] = tuple(value) if isinstance(value, list) else value
        elif f.metadata.get(ABSENT) is not None:
            kwargs[f.name] = f.metadata[ABSENT]()
        elif _default(f) is MISSING:
            missing.append("--" + prefix + (f.metadata.get(FLAG) or f.name.replace("_", "-")))
    if missing:
        others = f" too (with the other --{prefix}* flags)" if prefix else ""
        raise ValueError(f"{' and '.join(missing)} must be given{others}")
    return cls(**kwargs)


def reference(commands: dict[str, tuple[type, frozenset[str]]], intro: str) -> str:
    """The configuration reference (Markdown): one table per section of each command's tree
    (in the order sections first appear, as --help groups them), without the flag names a
    command leaves out."""
    lines = [intro, ""]
    for command, (cls, skip) in commands.items():
        lines += [f"## `pdserve {command}`", ""]
        flags = [f for f in tree_flags(cls) if f.name not in skip]
        for section in dict.fromkeys(flag.section for flag in flags):
            lines += ["", f"### {section or 'General'}", "", "| flag | field | default | what it sets |"]
            lines.append("|---|---|---|---|")
            for flag in (f for f in flags if f.section == section):
                kind = "on/off" if flag.boolean else "/".join(map(str, flag.choices)) if flag.choices else ""
                name = f"`--{flag.name}`" + (f" ({kind})" if kind else "") + (" ..." if flag.many else "")
                help_text = flag.help.replace("|", "\\|")
                lines.append(f"| {name} | `{'.'.join(flag.path)}` | `{flag.shown_default}` | {help_text} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
