"""Settings declared once: a config dataclass field carries its default, its help and its constraint.

Every process builds one frozen config from its command line. A field declared with `setting(...)` is
the only place its default, its flag's help and its rule live; from the fields this module generates the
argparse flags (`add_arguments`), the config itself (`from_args`), the start-up check with an error that
names the flag (`validate`, called by the config's __post_init__), and the flags `tpserve launch` passes
on to a child process (`to_argv`, for the fields declared with launch=True).

A pure policy (the scheduler's SchedulingPolicy, the router's RoutingPolicy and AdmissionPolicy) declares
its own knobs the same way and is embedded in its process's config with `nested(Policy)`: its flags
appear flat on the process's command line, and the policy stays free of argparse (this module only
reads the metadata). Plain Python: no gRPC, no torch.

Flag types come from the field annotations: int, float, str, bool (--x/--no-x), `T | None` (unset is
None), tuple[int, ...] (comma-separated) and tuple[str, ...] (a repeatable flag).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

# ---- rules ----


@dataclass(frozen=True)
class Rule:
    """A constraint on one value: `test(value)` holds, described as `text` in the error."""

    test: Callable[[Any], bool]
    text: str

    def __call__(self, value) -> bool:
        return self.test(value)


def _number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def at_least(low) -> Rule:
    return Rule(lambda v: _number(v) and v >= low, f"a number >= {low}")


def above(low) -> Rule:
    return Rule(lambda v: _number(v) and v > low, f"a number > {low}")


def between(low, high, *, low_open: bool = False) -> Rule:
    bracket = "(" if low_open else "["
    return Rule(
        lambda v: _number(v) and (v > low if low_open else v >= low) and v <= high,
        f"in {bracket}{low}, {high}]",
    )


POWER_OF_TWO = Rule(lambda v: isinstance(v, int) and v > 0 and not v & (v - 1), "a power of two")


# ---- declaring ----


@dataclass(frozen=True)
class Setting:
    help: str
    flag: str | None = None  # default: --field-name
    rule: Rule | None = None
    choices: tuple | None = None
    launch: bool = False  # `tpserve launch` takes the flag and passes it to the process
    required: bool = False


def setting(
    default=dataclasses.MISSING,
    *,
    help: str,
    flag: str | None = None,
    rule: Rule | None = None,
    choices: tuple | None = None,
    launch: bool = False,
):
    """A config field that is also a command-line flag. No default: the flag is required."""
    meta = Setting(
        help=help,
        flag=flag,
        rule=rule,
        choices=choices,
        launch=launch,
        required=default is dataclasses.MISSING,
    )
    return dataclasses.field(default=default, metadata={"setting": meta})


def nested(cls):
    """A group of settings declared by another dataclass (a policy): flags flat, value a cls instance."""
    return dataclasses.field(default_factory=cls, metadata={"nested": cls})


@dataclass(frozen=True)
class _Flag:
    name: str  # the dataclass field
    flag: str  # --the-flag
    dest: str  # argparse's attribute
    kind: str  # "bool", "list" (repeatable), "csv" (comma-separated ints), "scalar"
    parse: Callable[[str], Any] | None
    setting: Setting
    default: Any


def _base_type(tp) -> tuple[Any, bool]:
    """(the type, whether None is allowed) of an annotation such as `int | None`."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _flags(cls) -> Iterator[tuple[_Flag | None, dataclasses.Field, type | None]]:
    """(flag or None, field, nested class or None) for cls's fields, in declaration order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if "nested" in f.metadata:
            yield None, f, f.metadata["nested"]
            continue
        meta = f.metadata.get("setting")
        if meta is None:
            continue
        tp, _ = _base_type(hints[f.name])
        flag = meta.flag or "--" + f.name.replace("_", "-")
        dest = flag.removeprefix("--").replace("-", "_")
        if tp is bool:
            kind, parse = "bool", None
        elif typing.get_origin(tp) is tuple:
            item = typing.get_args(tp)[0]
            kind, parse = ("list", item) if item is str else ("csv", _csv(item))
        else:
            kind, parse = "scalar", tp
        default = f.default if f.default is not dataclasses.MISSING else None
        yield _Flag(f.name, flag, dest, kind, parse, meta, default), f, None


def _csv(item: type) -> Callable[[str], tuple]:
    def parse(text: str) -> tuple:
        try:
            return tuple(item(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated {item.__name__}s, got {text!r}"
            ) from None

    parse.__name__ = f"comma-separated {item.__name__}s"
    return parse


def walk(cls) -> Iterator[_Flag]:
    """Every flag of cls, nested policies included."""
    for flag, _, sub in _flags(cls):
        if sub is not None:
            yield from walk(sub)
        else:
            yield flag


# ---- the command line ----


def add_arguments(parser: argparse.ArgumentParser, cls, *, launch_only: bool = False) -> None:
    """Adds cls's flags (launch_only: only those `tpserve launch` passes on). A flag the parser already
    has (two processes taking the same one, such as --model) is added once."""
    for f in walk(cls):
        if launch_only and not f.setting.launch:
            continue
        if f.flag in parser._option_string_actions:
            continue
        s = f.setting
        help_text = s.help
        if f.default not in (None, False, ()) and not s.required:
            shown = ",".join(map(str, f.default)) if isinstance(f.default, tuple) else f.default
            help_text += f" (default: {shown})"
        help_text = help_text.replace("%", "%%")
        if f.kind == "bool":
            parser.add_argument(
                f.flag, dest=f.dest, action=argparse.BooleanOptionalAction, default=f.default, help=help_text
            )
        elif f.kind == "list":
            # Repeatable, and several values after one flag (vLLM's `--lora-modules a=x b=y`).
            parser.add_argument(f.flag, dest=f.dest, action="extend", nargs="+", default=[], help=help_text)
        else:
            parser.add_argument(
                f.flag,
                dest=f.dest,
                type=f.parse,
                default=f.default,
                choices=s.choices,
                required=s.required,
                help=help_text,
            )


def from_args(cls, ns: argparse.Namespace, **values):
    """Builds cls from parsed flags; `values` fills (or overrides) fields that are not flags."""
    kwargs = {}
    for flag, field, sub in _flags(cls):
        if field.name in values:
            continue
        if sub is not None:
            kwargs[field.name] = from_args(sub, ns)
        elif hasattr(ns, flag.dest):
            value = getattr(ns, flag.dest)
            kwargs[field.name] = tuple(value) if flag.kind == "list" else value
    return cls(**kwargs, **values)


def to_argv(ns: argparse.Namespace, cls, *, launch_only: bool = True) -> list[str]:
    """The flags that reproduce ns's values of cls's settings, for a child process's command line."""
    argv = []
    for f in walk(cls):
        if launch_only and not f.setting.launch:
            continue
        value = getattr(ns, f.dest)
        if f.kind == "bool":
            argv.append(f.flag if value else "--no-" + f.flag.removeprefix("--"))
        elif f.kind == "list":
            for item in value:
                argv += [f.flag, str(item)]
        elif f.kind == "csv":
            argv += [f.flag, ",".join(map(str, value))]
        elif value is not None:
            argv += [f.flag, str(value)]
    return argv


def validate(obj) -> None:
    """Checks every setting of obj against its rule and choices; the error names the flag."""
    hints = typing.get_type_hints(type(obj))
    by_name = {f.name: f for f, _, sub in _flags(type(obj)) if sub is None}
    for name, f in by_name.items():
        value = getattr(obj, name)
        if value is None:
            if not _base_type(hints[name])[1] and not f.setting.required:
                raise ValueError(f"{f.flag} must be set, got None")
            continue
        s = f.setting
        if s.choices is not None and value not in s.choices:
            raise ValueError(f"{f.flag} must be one of {', '.join(map(str, s.choices))}, got {value!r}")
        if s.rule is not None:
            items = value if isinstance(value, tuple) else (value,)
            for item in items:
                if not s.rule(item):
                    raise ValueError(f"{f.flag} must be {s.rule.text}, got {item!r}")
        _check_type(f, _base_type(hints[name])[0], value)


def _check_type(f: _Flag, tp, value) -> None:
    items = value if typing.get_origin(tp) is tuple else (value,)
    item_type = typing.get_args(tp)[0] if typing.get_origin(tp) is tuple else tp
    for item in items:
        if item_type is float:
            ok = isinstance(item, int | float) and not isinstance(item, bool)
        elif item_type is int:
            ok = isinstance(item, int) and not isinstance(item, bool)
        else:
            ok = isinstance(item, item_type)
        if not ok:
            raise ValueError(
                f"{f.flag} must be {'an' if item_type is int else 'a'} {item_type.__name__}, got {item!r}"
            )
