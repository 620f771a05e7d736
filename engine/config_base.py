"""The building blocks of config sections: frozen pydantic dataclasses validated in strict mode.

A section declares its knobs with their bounds and choices on the fields::

    @section
    class GeoConfig:
        k_steps: Annotated[int, Field(ge=1)] = 10
        delta_scale: Literal["mean", "sum"] = "mean"
        hosts: StrTuple = ()                          # a YAML list (or "a,b") -> tuple of str
        data: Annotated[DataConfig, Nested] = field(default_factory=DataConfig)   # a nested section

``build(cls, mapping, "geo")`` checks a mapping against it. Validation is pydantic's, in strict mode:
unknown keys are rejected, an int field takes only ints (not ``"3"``, ``3.0`` or ``true``), a float field
ints and floats but not ``nan``/``inf``, a bool field only ``true``/``false`` (not ``1`` or ``"yes"``).
Durations (``*_s`` fields) are bounded by ``Field(le=MAX_SECONDS)``.
Its errors become one ``ConfigError`` naming the key path, the value and what is allowed::

    geo.k_steps must be >= 1, got 0
    geo.delta_scale must be one of ['mean', 'sum'], got 'max'
    geo: unknown key(s) ['foo']; known keys: ['delta_scale', 'k_steps', ...]

A ``str`` field (or ``Literal`` of strings, or the items of a ``StrTuple``) gets the source text of a
scalar that YAML typed otherwise (``until: 2024010108``, ``--set model.until=0100``; see
``engine.config_yaml``), so strings stay as written. Constructing a section directly raises
``ConfigError`` too (the class name stands for the key path); ``dataclasses.replace`` and
``dataclasses.fields`` work as on any dataclass.
"""
from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Annotated, Any, Literal

import pydantic
from pydantic import ConfigDict, Field, ValidationError
from pydantic_core import ArgsKwargs, core_schema

from .config_yaml import Texts, parse_value, source_text
from .errors import ConfigError

__all__ = ["CONFIG", "MAX_SECONDS", "IntTuple", "Nested", "StrTuple", "build", "describe", "section"]

#: pydantic settings of every section: strict types, unknown keys rejected, no nan/inf floats
CONFIG = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

#: the longest duration (``*_s`` field) a config takes, seconds: 2^31 - 1 ms (24.8 days), the most gRPC's
#: millisecond options hold (``client.dead_after_s`` becomes a keepalive timeout in ms). Unbounded,
#: ``client.dead_after_s: 1e308`` killed every role with a traceback (a float infinity to int) and
#: ``client.timeout_s: 1e308`` hung the workers "waiting for the servers" until the watchdog stopped them
MAX_SECONDS = 2_147_483.0

#: a tuple field set from a YAML list (strict mode alone would want a tuple), or from "a,b"
StrTuple = Annotated[tuple[str, ...], Field(strict=False)]
IntTuple = Annotated[tuple[int, ...], Field(strict=False)]


class _Nested:
    """``Annotated`` marker of a field holding a nested section: it takes a mapping of that section's
    keys (pydantic's strict mode alone would only take an instance); errors keep the full key path."""

    def __get_pydantic_core_schema__(self, source, handler):
        return core_schema.no_info_before_validator_function(functools.partial(_from_mapping, source),
                                                             handler(source))

    def __repr__(self) -> str:
        return "Nested"


Nested = _Nested()


def _from_mapping(cls, value):
    if value is None:                # an empty section ("cluster:" in YAML): every default
        value = {}
    if not isinstance(value, dict):
        return value
    obj = cls.__new__(cls)
    cls.__pydantic_validator__.validate_python(ArgsKwargs((), {str(k): v for k, v in value.items()}),
                                               self_instance=obj)
    return obj


def section(cls):
    """Class decorator: ``cls`` becomes a frozen pydantic dataclass validated with ``CONFIG``.

    Direct construction (``GeoConfig(k_steps=0)``, ``dataclasses.replace``) raises ``ConfigError``
    naming ``GeoConfig.k_steps``.

    Raises
    ------
    TypeError
        A field holds a section without the ``Nested`` marker (it could never be set from YAML).
    """
    cls = pydantic.dataclasses.dataclass(frozen=True, config=CONFIG)(cls)
    for name, tp in _field_types(cls).items():
        base, _ = _base(tp)
        if _is_section(base) and not _marked_nested(tp):
            raise TypeError(f"{cls.__name__}.{name}: declare a nested section as "
                            f"Annotated[{base.__name__}, Nested]")
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        try:
            init(self, *args, **kwargs)
        except ValidationError as e:
            raise ConfigError(describe(e, type(self), type(self).__name__)) from None

    cls.__init__ = __init__
    return cls


def build(cls, data: Any, path: str = "", *, texts: Texts | None = None, at: tuple | None = None):
    """Build section ``cls`` from a mapping.

    Parameters
    ----------
    cls : a ``section`` class
    data : dict or None
        The section's keys (None: every default).
    path : str
        Key path of the section, named in errors (``"cluster"``, ``"tables.dense.bias"``; ``""`` at
        the top).
    texts : Texts, optional
        Source texts of the YAML scalars (``engine.config_yaml.Source.texts``); string fields take
        them.
    at : tuple, optional
        Key path of ``data`` within ``texts`` (default: ``path`` split on dots).

    Raises
    ------
    ConfigError
        Unknown keys, wrong types, values out of range or not among the choices; the message names the
        key path, the value and what is allowed.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'} must be a mapping, got {type(data).__name__} {data!r}")
    at = tuple(path.split(".")) if at is None and path else (at or ())
    data = {str(k): v for k, v in with_texts(cls, data, at, texts).items()}
    obj = cls.__new__(cls)
    try:
        cls.__pydantic_validator__.validate_python(ArgsKwargs((), data), self_instance=obj)
    except ValidationError as e:
        raise ConfigError(describe(e, cls, path)) from None
    return obj


# ------------------------------------------------------------------------------- types of fields
@functools.cache
def _field_types(cls) -> dict[str, Any]:
    """Field name -> annotation (with ``Annotated`` extras) of a dataclass."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls)}


def _base(tp) -> tuple[Any, bool]:
    """(the type without ``Annotated`` and ``Optional``, whether None is allowed)."""
    optional = False
    while True:
        if typing.get_origin(tp) is Annotated:
            tp = typing.get_args(tp)[0]
            continue
        args = typing.get_args(tp)
        if type(None) in args and typing.get_origin(tp) is not Literal:
            rest = [a for a in args if a is not type(None)]
            optional = True
            if len(rest) == 1:
                tp = rest[0]
                continue
        return tp, optional


def _marked_nested(tp) -> bool:
    """Whether ``tp`` carries the ``Nested`` marker (through ``Optional`` too)."""
    while True:
        if typing.get_origin(tp) is Annotated:
            if any(m is Nested for m in tp.__metadata__):
                return True
            tp = typing.get_args(tp)[0]
            continue
        rest = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(rest) == 1 and len(typing.get_args(tp)) == 2 and typing.get_origin(tp) is not Literal:
            tp = rest[0]
            continue
        return False


def _is_section(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _is_text(tp) -> bool:
    """A field that takes a string as written: ``str`` or a ``Literal`` of strings."""
    if tp is str:
        return True
    return typing.get_origin(tp) is Literal and all(isinstance(a, str) for a in typing.get_args(tp))


def _item_type(tp):
    """Item type of ``tuple[X, ...]`` (None for any other type)."""
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return args[0]
    return None


# ------------------------------------------------------------------------------- source texts
def with_texts(cls, data: dict, at: tuple, texts: Texts | None) -> dict:
    """``data`` with every string-typed field's scalar replaced by its source text (see the module
    docstring), recursively through nested sections and tuples; a string for a tuple field is split
    on commas (``"C1,C2"``, ``"400,200"``: each piece is read as a YAML scalar, or kept as text for
    string items). Works on any dataclass (also ``sparse_tables.TableConfig``)."""
    types = _field_types(cls)
    return {k: (_typed(types[k], v, at + (k,), texts) if k in types else v) for k, v in data.items()}


def _typed(tp, value, path: tuple, texts: Texts | None):
    base, optional = _base(tp)
    if value is None and optional:
        return None
    if _is_text(base):
        text = source_text(texts, path, value)
        return value if text is None else text
    if _is_section(base) and isinstance(value, dict):
        return with_texts(base, value, path, texts)
    item = _item_type(base)
    if item is not None:
        if isinstance(value, str):
            pieces = [p.strip() for p in value.split(",") if p.strip()]
            text_items = _is_text(_base(item)[0])
            return [p if text_items else parse_value(p, f"{_dotted(path)}: {p!r}")[0] for p in pieces]
        if isinstance(value, (list, tuple)):
            return [_typed(item, v, path + (i,), texts) for i, v in enumerate(value)]
    return value


# ------------------------------------------------------------------------------- errors
def _dotted(path, prefix: str = "") -> str:
    out = prefix
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _type_at(cls, loc: tuple):
    """The field type (without ``Annotated``/``Optional``) at ``loc`` below section ``cls``, or None."""
    tp = cls
    for part in loc:
        base, _ = _base(tp)
        if _is_section(base) and isinstance(part, str):
            tp = _field_types(base).get(part)
        elif _item_type(base) is not None and isinstance(part, int):
            tp = _item_type(base)
        elif typing.get_origin(base) is dict and len(typing.get_args(base)) == 2:
            tp = typing.get_args(base)[1]
        else:
            return None
        if tp is None:
            return None
    return _base(tp)[0]


_EXPECTED = {
    "int_type": "an int", "int_parsing": "an int", "int_from_float": "an int",
    "float_type": "a number", "float_parsing": "a number", "finite_number": "a finite number",
    "bool_type": "true or false", "bool_parsing": "true or false",
    "string_type": "a string", "tuple_type": "a list", "list_type": "a list",
    "dict_type": "a mapping", "dataclass_type": "a mapping", "dataclass_exact_type": "a mapping",
    "dataclass_args_type": "a mapping",
}
_BOUNDS = {"greater_than": ("gt", ">"), "greater_than_equal": ("ge", ">="), "less_than": ("lt", "<"),
           "less_than_equal": ("le", "<=")}


def _shown(value, tp) -> str:
    if tp is float and type(value) is int:
        value = float(value)
    return repr(value)


def _message(err: dict, cls, path: str) -> str:
    loc = tuple(err["loc"])
    kp = _dotted(loc, path) or "config"
    kind, value, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    tp = _type_at(cls, loc)
    if kind == "value_error" and isinstance(ctx.get("error"), ConfigError):
        return str(ctx["error"])            # a section's own check; its message names the key
    if kind in ("missing", "missing_argument"):
        return f"{kp}: missing"
    if kind == "literal_error" and typing.get_origin(tp) is Literal:
        return f"{kp} must be one of {list(typing.get_args(tp))}, got {value!r}"
    if kind in _BOUNDS:
        key, op = _BOUNDS[kind]
        bound = ctx.get(key)
        if isinstance(bound, float) and bound.is_integer():
            bound = int(bound)            # pydantic hands a float field's bound as a float: "> 0", not "> 0.0"
        return f"{kp} must be {op} {bound}, got {_shown(value, tp)}"
    if kind in _EXPECTED:
        return f"{kp} must be {_EXPECTED[kind]}, got {_shown(value, tp)}"
    if kind == "value_error" and ctx.get("error") is not None:
        return f"{kp}: {ctx['error']}"
    return f"{kp}: {err['msg']}, got {value!r}"


def describe(exc: ValidationError, cls, path: str = "") -> str:
    """One message for every error of ``exc`` (raised validating section ``cls`` at key ``path``),
    joined by ``"; "``; unknown keys of one section are listed together with its known keys."""
    parts: list = []
    unknown: dict[tuple, list] = {}
    for err in exc.errors(include_url=False):
        if err["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
            parent = tuple(err["loc"])[:-1]
            if parent not in unknown:
                unknown[parent] = []
                parts.append(parent)
            unknown[parent].append(str(err["loc"][-1]))
            continue
        parts.append(_message(err, cls, path))
    out = []
    for part in parts:
        if isinstance(part, tuple):
            owner = _type_at(cls, part)
            known = sorted(_field_types(owner)) if _is_section(owner) else []
            out.append(f"{_dotted(part, path) or 'config'}: unknown key(s) {sorted(unknown[part])}; "
                       f"known keys: {known}")
        elif part not in out:
            out.append(part)
    return "; ".join(out)
