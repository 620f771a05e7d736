"""YAML 1.2 reading that keeps each scalar's source text, for config files and ``--set`` values.

YAML types a plain scalar before any config field sees it: ``until: 2024010108`` is an int,
``until: 0100`` the int 100 and ``2024-01-01`` a date. A string field must get the text as written, so
the reader keeps, next to the values, the source text of every scalar that YAML typed as something
other than a string::

    >>> doc = load_yaml("model:\\n  until: 0100\\n  epochs: 2\\n  tag: yes\\n", "c.yaml")
    >>> doc
    {'model': {'until': 100, 'epochs': 2, 'tag': 'yes'}}
    >>> doc.texts[("model", "until")], doc.texts[("model", "epochs")]
    ((100, '0100'), (2, '2'))

A ``null`` (or ``~``) stays None (a string field refuses it); an empty value (``root:``) has the text
``""``.

``engine.config_base.build`` hands a ``str`` field that text (see ``source_text``); every other field
gets the YAML value. The loader is YAML 1.2 (ruamel.yaml's safe mode): ``yes``/``no``/``on``/``off``
are strings, not booleans, and ``0100`` is 100, not octal 64. Mapping keys are always their text
(config keys are names). Anchors, aliases and merge keys (``<<: *base``) work; duplicate keys are an
error naming both lines, and so is nesting deeper than ``MAX_FLOW_DEPTH`` levels of ``[``/``{``.
"""
from __future__ import annotations

import re
from typing import Any

from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError
from ruamel.yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from .errors import ConfigError

__all__ = ["Source", "Texts", "load_yaml", "parse_value", "source_text"]

#: key path (mapping keys and list indices from the top) -> (the YAML value, its source text)
Texts = dict[tuple, tuple[Any, str]]

_MERGE_TAG = "tag:yaml.org,2002:merge"


class Source(dict):
    """A config mapping read from YAML or built by ``--set``, with the source text of its scalars.

    It is a plain ``dict`` of the YAML values; ``texts`` (see ``Texts``) records, for every scalar that
    YAML typed as a non-string (int, float, bool, null, date), its text as written. ``copy.deepcopy``
    keeps ``texts``; ``dict(source)`` drops it.
    """

    def __init__(self, data=(), texts: Texts | None = None):
        super().__init__(data)
        self.texts: Texts = dict(texts or {})


def source_text(texts: Texts | None, path: tuple, value) -> str | None:
    """The source text of ``value`` found at key path ``path``, or None.

    None when nothing was recorded there, or when the value was replaced since it was read (the
    recorded value differs from ``value``): a text never stands for a value it was not read as.
    """
    rec = (texts or {}).get(path)
    if rec is None:
        return None
    was, text = rec
    if was is value or (type(was) is type(value) and was == value):
        return text
    return None


def _yaml() -> YAML:
    return YAML(typ="safe", pure=True)


def _dotted(path: tuple) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


def _construct(root: Node, where: str) -> tuple[Any, Texts]:
    """Python values of a composed YAML node tree plus the source texts of its non-string scalars."""
    constructor = _yaml().constructor
    texts: Texts = {}
    open_nodes: set[int] = set()

    def walk(node: Node, path: tuple):
        if isinstance(node, ScalarNode):
            value = constructor.construct_object(node, deep=True)
            if isinstance(value, str) or (value is None and node.value):
                texts.pop(path, None)       # a string is its text; null/~ stays null, only an empty value is ""
            else:
                texts[path] = (value, node.value)
            return value
        if id(node) in open_nodes:
            raise ConfigError(f"{where}: {_dotted(path)} refers to itself through an alias")
        open_nodes.add(id(node))
        try:
            if isinstance(node, SequenceNode):
                return [walk(item, path + (i,)) for i, item in enumerate(node.value)]
            if not isinstance(node, MappingNode):
                raise ConfigError(f"{where}: {_dotted(path)}: unsupported YAML node {node.tag}")
            out: dict = {}
            merges = [v for k, v in node.value if k.tag == _MERGE_TAG]
            for merged in merges:       # YAML merge keys: earlier mappings win, explicit keys win over all
                sources = merged.value if isinstance(merged, SequenceNode) else [merged]
                for src in reversed(sources):
                    if not isinstance(src, MappingNode):
                        raise ConfigError(f"{where}: {_dotted(path)}: a merge key (<<) must name mappings")
                    out.update(walk(src, path))
            seen: dict = {}         # key -> its 0-based line
            for k, v in node.value:
                if k.tag == _MERGE_TAG:
                    continue
                if not isinstance(k, ScalarNode):
                    raise ConfigError(f"{where}: {_dotted(path)}: mapping keys must be names, got a "
                                      f"{'list' if isinstance(k, SequenceNode) else 'mapping'}")
                key = k.value
                if key in seen:         # PyYAML would keep the last one without a word
                    raise ConfigError(f"{where}: duplicate key {_dotted(path + (key,))} (line "
                                      f"{seen[key] + 1}, again at line {k.start_mark.line + 1})")
                seen[key] = k.start_mark.line
                out[key] = walk(v, path + (key,))
            return out
        finally:
            open_nodes.discard(id(node))

    return walk(root, ()), texts


def _yaml_error(e: YAMLError) -> str:
    """A YAML error on one line: the problem and where it is."""
    problem, mark = getattr(e, "problem", None), getattr(e, "problem_mark", None)
    if problem and mark is not None:
        return f"{problem} (line {mark.line + 1}, column {mark.column + 1})"
    return " ".join(str(e).split())


#: the deepest nesting of ``[...]`` / ``{...}`` a document may have (the shipped configs: 2). ruamel's
#: scanner takes time quadratic in it (2000 levels on one line: 22 s) and its composer recurses once per
#: level (500 levels: a RecursionError traceback)
MAX_FLOW_DEPTH = 100
# what can hide a bracket: a quoted scalar, a comment (an apostrophe in a plain scalar also opens a
# "quote" here: it can only hide brackets, and Python's recursion limit stays the last guard)
_FLOW_TOKENS = re.compile(r""""(?:[^"\\]|\\.)*"|'(?:[^']|'')*'|#[^\n]*|[\[\]{}]""")


def _check_flow_depth(text: str, where: str, what: str) -> None:
    """Refuse a document whose ``[``/``{`` nesting passes ``MAX_FLOW_DEPTH``, naming the line."""
    if text.count("[") + text.count("{") <= MAX_FLOW_DEPTH:
        return
    depth = 0
    for m in _FLOW_TOKENS.finditer(text):
        tok = m.group()
        if tok in "[{":
            depth += 1
            if depth > MAX_FLOW_DEPTH:
                line = text.count("\n", 0, m.start()) + 1
                raise ConfigError(f"{where}: {what}: [ and {{ nested more than {MAX_FLOW_DEPTH} deep (line {line})")
        elif tok in "]}":
            depth = max(0, depth - 1)


def _compose(text: str, where: str, what: str = "not valid YAML") -> Node | None:
    _check_flow_depth(text, where, what)
    try:
        return _yaml().compose(text)
    except YAMLError as e:
        raise ConfigError(f"{where}: {what}: {_yaml_error(e)}") from None
    except RecursionError:          # nested past Python's recursion limit (block mappings, one per line)
        raise ConfigError(f"{where}: {what}: nested too deep") from None


def load_yaml(text: str, where: str) -> Source:
    """Parse a YAML config document (YAML 1.2) keeping the source text of its scalars.

    Parameters
    ----------
    text : str
        The document.
    where : str
        Named in errors (the file path).

    Returns
    -------
    Source
        The top-level mapping (empty for an empty document) with ``texts``.

    Raises
    ------
    ConfigError
        Not valid YAML, not a mapping at the top level, a duplicate key, a non-scalar key, ``[``/``{``
        nested deeper than ``MAX_FLOW_DEPTH`` (or anything past Python's recursion limit).
    """
    node = _compose(text, where)
    if node is None:
        return Source()
    try:
        value, texts = _construct(node, where)
    except YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {_yaml_error(e)}") from None
    except RecursionError:
        raise ConfigError(f"{where}: not valid YAML: nested too deep") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: config must be a mapping at the top level, got {type(value).__name__}")
    return Source(value, texts)


def parse_value(raw: str, where: str) -> tuple[Any, Texts]:
    """A ``--set`` value: the YAML 1.2 value of ``raw`` and the source texts below it.

    A scalar's text is ``raw`` itself (stripped), so a string field given ``--set model.until=0100``
    gets ``"0100"``; an empty ``raw`` is the empty string, ``null`` stays None.

    Returns
    -------
    value, texts
        ``texts`` keyed by paths relative to the value (``()`` for a scalar value).

    Raises
    ------
    ConfigError
        ``raw`` is not valid YAML (``where`` is named).
    """
    text = raw.strip()
    if not text:
        return "", {}
    node = _compose(raw, where, "value is not valid YAML")
    if node is None:                 # only a comment
        return None, {}
    try:
        value, texts = _construct(node, where)
    except YAMLError as e:
        raise ConfigError(f"{where}: value is not valid YAML: {_yaml_error(e)}") from None
    except RecursionError:
        raise ConfigError(f"{where}: value is not valid YAML: nested too deep") from None
    if isinstance(node, ScalarNode) and not isinstance(value, str) and value is not None:
        texts[()] = (value, text)
    return value, texts
