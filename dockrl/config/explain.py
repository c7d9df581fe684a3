"""Where the values a config error is about came from: ``explain_error`` adds it to the message of an error
``load_config_text`` raises (the text's ``source`` first, or ``(<field> is the default <value>)``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Iterable

from dockrl.config.config import Config


def explain_error(message: str, source: str, in_text: dict[str, Any], overridden: dict[str, Any]) -> str:
    """``message`` of a config error, with where the values it is about came from.

    It starts with ``source`` when a value or key at fault came from the text (not replaced by an
    override) and no override is named in it; it ends with ``(<field> is the default <value>)`` for
    each field it names (not one it only suggests another value for, ``<field>=<value>``) that
    neither the text nor an override sets: a cross-field rule that failed on a value the user never set.
    """
    defaults = _defaults(Config)
    set_by = _paths(overridden)
    where = message.split(":", 1)[0].split(" ", 1)[0]
    where = "" if where == "config" else where  # an unknown section
    named = _named(message, defaults)
    node = _get(in_text, where)
    if isinstance(node, dict):  # a section of the text (or all of it): its keys that are no field are at fault, not it
        faulty = [p for p in (f"{where}.{k}" if where else str(k) for k in node) if p not in defaults]
    else:
        faulty = [where]
    def overridden_at(p: str) -> bool:  # an override set it, or a key under it
        return any(s == p or s.startswith(f"{p}.") for s in set_by)

    # a value at fault came from the text when no override replaced it
    from_text = any(_get(in_text, p) is not _ABSENT and not overridden_at(p) for p in faulty + named)
    if from_text and not _named(message, set_by):
        message = f"{source}: {message}"
    # a field named as `field=<another value>` only is a suggestion, not a value the rule failed on
    stated = [p for p in named if f"{p}=" not in message or any(f"{p}={v}" in message for v in (defaults[p], repr(defaults[p])))]
    unset = [p for p in stated if not dataclasses.is_dataclass(defaults[p]) and _get(in_text, p) is _ABSENT and not overridden_at(p)]
    if unset:
        message += " (" + ", ".join(f"{p} is the default {defaults[p]!r}" for p in unset) + ")"
    return message


def _named(message: str, paths: Iterable[str]) -> list[str]:
    """The dotted ``paths`` that ``message`` names (not as part of a longer path), in the order it names them."""
    found = {p: m.start() for p in paths if (m := re.search(rf"(?<![\w.]){re.escape(p)}(?!\w|\.\w)", message))}
    return sorted(found, key=found.__getitem__)


def _defaults(cls: Any, prefix: str = "") -> dict[str, Any]:
    """The dotted path of every field of the dataclass ``cls`` (sections and their fields) to its default."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        value = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        out[prefix + f.name] = value
        if dataclasses.is_dataclass(value):
            out |= _defaults(value, f"{prefix}{f.name}.")
    return out


def _paths(tree: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted paths of the fields ``tree`` sets (``parse_overrides``' output)."""
    out = []
    for name, value in tree.items():
        path = f"{prefix}{name}"
        out += _paths(value, f"{path}.") if isinstance(value, dict) else [path]
    return out


_ABSENT = object()


def _get(tree: dict[str, Any], where: str) -> Any:
    """The value at the dotted path ``where`` of the nested mapping ``tree`` ("": ``tree``), or ``_ABSENT``."""
    node: Any = tree
    for part in where.split(".") if where else ():
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    return node
