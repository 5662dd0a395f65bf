"""Field metadata for the configuration tree: help, flag name, parser, section prefixes.

Every config dataclass marks its fields with `knob` (a settable value) or `section` (a
nested config). `configuration.flags` turns the tree into command-line flags and the
configuration reference; the default stays in the dataclass, the one place it is written.
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, field
from typing import Any, Callable

HELP = "pdserve.help"
FLAG = "pdserve.flag"  # flag name without "--" (default: the field name with dashes)
PARSE = "pdserve.parse"  # str -> value, for types the annotation cannot say (sizes, files)
HIDDEN = "pdserve.hidden"  # derived or programmatic: no flag
PREFIX = "pdserve.prefix"  # sections: prefix of their fields' flags
TITLE = "pdserve.title"  # sections: heading of their flags in --help and the docs
ABSENT = "pdserve.absent"  # called with no value when the flag is not given (e.g. read an env)
SHOWN = "pdserve.shown"  # the default as --help and the docs say it, where it depends on the host


def knob(
    default: Any = MISSING,
    *,
    help: str,  # noqa: A002  (argparse's word)
    flag: str | None = None,
    parse: Callable[[str], Any] | None = None,
    default_factory: Callable[[], Any] | Any = MISSING,
    hidden: bool = False,
    absent: Callable[[], Any] | None = None,
    shown: str | None = None,
) -> Any:
    """A settable field: `help` is the one line users read in --help and the docs."""
    metadata = {HELP: help, FLAG: flag, PARSE: parse, HIDDEN: hidden, ABSENT: absent, SHOWN: shown}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def section(factory: Callable[[], Any] | None, *, title: str, prefix: str = "") -> Any:
    """A nested config; None as factory: an optional section, built only if one of its flags is given."""
    metadata = {TITLE: title, PREFIX: prefix, HELP: title}
    if factory is None:
        return field(default=None, metadata=metadata)
    return field(default_factory=factory, metadata=metadata)


def default_of(cls: type, name: str) -> Any:
    """A field's default as its own dataclass writes it, for a knob that feeds it."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not MISSING:
                return f.default
            if f.default_factory is not MISSING:
                return f.default_factory()
            raise ValueError(f"{cls.__name__}.{name} has no default")
    raise AttributeError(f"{cls.__name__} has no field {name!r}")
