"""Dataclass fields as options: their types, their docstrings, and text turned into values.

One mechanism for every typed set of options (`TrainConfig`, `DDPConfig`, a pipeline's
`Args`, bench's and the cost model's options): the command line builds its flags from it
(`raytrain.cli`), `TrainConfig` checks the types of its values with it, and
`--pipeline-arg KEY=VALUE` is converted with it. The type of a field says what it takes
(`int`, `float | None`, `int | str`, a `Literal` of choices, a nested dataclass); its
docstring, the string under it in the class body, is its help. What a type cannot say sits
in the field's metadata:

- `parse`: text -> value, for a value written in its own syntax (e.g. comma-separated
  numbers); raises ValueError with the fix,
- `flags`: the command-line spellings, when not `--field-name` (e.g. `("-v", "--verbose")`),
- `switch`: a boolean that is only ever turned on (`--resume`, no `--no-resume`),
- `repeat`: the flag may be given several times, each value appended,
- `metavar`: how --help shows the value,
- `text`: an optional string whose every word is text (a name): `none`, `null` and the empty
  string are values, never "no value" (`--name none` names the run "none").
- `default_text`: how --help shows the default, when the value alone would not say it (a
  default that depends on other options, a None that means "decided at run time").
- `instead_of`: the other field of a pair of which a layer of options that names one replaces
  the other from the layers below (`--max-steps` instead of a pipeline's `epochs`;
  `raytrain.config.tree.merge_layers`),
- `on_resume`: what `--resume` makes of a change to the field (`raytrain.rules.resume`):
  `order` (it reorders an epoch), `state` (the checkpoint's optimizer state cannot follow it)
  or `invocation` (it is about this invocation, not the run).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Union

_WORDS = {
    int: "an integer",
    float: "a number",
    bool: "true or false",
    str: "a string",
    dict: "a mapping of KEY: value",
    list: "a list, e.g. [30, 60]",
}
_NONE_WORDS = ("none", "null", "")
_TRUE, _FALSE = ("true", "yes", "1"), ("false", "no", "0")


def flag_name(field_name: str) -> str:
    """The command-line spelling of a field: `global_batch_size` -> `--global-batch-size`; a
    nested one, `ddp.bucket_cap_mb` -> `--ddp-bucket-cap-mb`."""
    return "--" + field_name.replace(".", "-").replace("_", "-")


@dataclass(frozen=True)
class Option:
    """One field of an options dataclass, as the command line and the checks see it."""

    name: str
    kinds: tuple[type, ...]
    """The value types the field takes, in the order declared (None left out; a Literal's
    values count as their type; `list[int]` as `list`). Empty: anything."""
    optional: bool
    """None is a value of the field."""
    choices: tuple[Any, ...] | None
    """The values of a Literal type."""
    help: str | None
    default: Any
    """The field's default (its default_factory called), or dataclasses.MISSING."""
    metadata: Mapping[str, Any]

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING

    @property
    def nested(self) -> type | None:
        """The dataclass a field of options holds (TrainConfig.ddp: DDPConfig)."""
        return self.kinds[0] if len(self.kinds) == 1 and dataclasses.is_dataclass(self.kinds[0]) else None

    @property
    def flags(self) -> tuple[str, ...]:
        spelled = self.metadata.get("flags") or (flag_name(self.name),)
        return (spelled,) if isinstance(spelled, str) else tuple(spelled)

    @property
    def type_name(self) -> str:
        """`int`, `float`, ...: what argparse names in `invalid int value: 'abc'`."""
        return self.kinds[0].__name__ if self.kinds else "str"

    def words(self, none: bool = False) -> str:
        """What the field takes, in words: `an integer or a string` (`or none` with `none`)."""
        names = [_WORDS.get(kind, kind.__name__) for kind in self.kinds]
        if none and self.optional:
            names.append("none")
        return " or ".join(dict.fromkeys(names)) or "anything"

    def default_words(self) -> str | None:
        """The default as --help shows it (`default_text`, else the value; none: None or empty);
        None for a required field."""
        if self.metadata.get("default_text"):
            return str(self.metadata["default_text"])
        if self.default is dataclasses.MISSING:
            return None
        if self.default is None or self.default in ({}, [], ""):
            return "none"
        if isinstance(self.default, bool):
            return "on" if self.default else "off"
        if isinstance(self.default, (list, tuple)):
            return ",".join(map(str, self.default))
        return f"{self.default:g}" if isinstance(self.default, float) else str(self.default)

    def accepts(self, value: Any) -> bool:
        """Whether `value` (from Python or YAML) has one of the field's types: an int is a
        float, a bool is no number."""
        if value is None:
            return self.optional or not self.kinds
        if isinstance(value, bool):
            return bool in self.kinds or not self.kinds
        return not self.kinds or any(
            isinstance(value, kind) or (kind is float and isinstance(value, int)) for kind in self.kinds
        )

    def from_text(self, value: Any) -> Any:
        """`value` (text, or a YAML value) as the field's type: the field's own `parse` for
        text; none/null/empty is None for an optional field, unless the field is marked `text`
        (a name: every word is text); text stays text where the field takes a string
        (`--workers 2` is "2", as `--workers 2:8` is "2:8"); else the first declared type it
        converts to. ValueError when nothing fits."""
        parse = self.metadata.get("parse")
        if parse is not None and isinstance(value, str):
            return parse(value)
        if isinstance(value, str) and self.metadata.get("text"):
            return value
        if value is None or (isinstance(value, str) and value.strip().lower() in _NONE_WORDS):
            if self.optional:
                return None
        if isinstance(value, str) and (str in self.kinds or not self.kinds):
            return value
        for kind in self.kinds or (str,):
            converted = _convert(value, kind)
            if converted is not _NO:
                return converted
        raise ValueError(value)


_NO = object()


def _convert(value: Any, kind: type) -> Any:
    """`value` as `kind`, or _NO."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        return True if text in _TRUE else False if text in _FALSE else _NO
    if kind in (int, float):
        if isinstance(value, bool) or (kind is int and isinstance(value, float) and not value.is_integer()):
            return _NO
        try:
            return kind(value)
        except (TypeError, ValueError):
            return _NO
    if kind is str:
        return str(value)
    return value if isinstance(value, kind) else _NO


@functools.cache
def options(cls: type) -> tuple[Option, ...]:
    """Every field of the dataclass `cls` (an instance's class works too), in order."""
    cls = cls if isinstance(cls, type) else type(cls)
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an annotation that names what its module cannot resolve
        hints = {}
    docs = field_docs(cls)
    found = []
    for f in dataclasses.fields(cls):
        kinds, optional, choices = _analyse(hints.get(f.name, f.type))
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        found.append(Option(f.name, kinds, optional, choices, docs.get(f.name), default, f.metadata))
    return tuple(found)


def option(cls: type, name: str) -> Option:
    return next(o for o in options(cls) if o.name == name)


def marked(cls: type, key: str, value: Any) -> tuple[str, ...]:
    """The names of the fields of `cls` whose metadata sets `key` to `value`, in field order."""
    return tuple(o.name for o in options(cls) if o.metadata.get(key) == value)


def _analyse(hint: Any) -> tuple[tuple[type, ...], bool, tuple[Any, ...] | None]:
    """(kinds, optional, choices) of a resolved type hint."""
    if isinstance(hint, str) or hint is Any:  # unresolved: take anything
        return (), True, None
    parts = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)
    kinds: list[type] = []
    optional, choices = False, None
    for part in parts:
        origin = typing.get_origin(part)
        if part is type(None):
            optional = True
        elif origin is Literal:
            choices = typing.get_args(part)
            for value in choices:
                if type(value) not in kinds:
                    kinds.append(type(value))
        elif isinstance(origin, type):
            kinds.append(origin)
        elif isinstance(part, type):
            kinds.append(part)
    return tuple(kinds), optional, choices


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal under it in the class body), bases first;
    {} when the source cannot be read (a class made at run time)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, following in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[node.target.id] = " ".join(following.value.value.split())
    return docs


__all__ = ["Option", "field_docs", "flag_name", "marked", "option", "options"]
