"""Loading a config: YAML text or file, ``section.field=value`` overrides, ``load_config``, ``dump_config``.

``load_config(path, overrides)`` reads an optional YAML file, applies ``section.field=value``
overrides from the command line, checks every field's type and allowed values and the
cross-field rules, and returns a ``Config``; it probes nothing, so ``auto`` fields stay ``auto``
until ``dockrl.config.resolve.resolve_auto``. The defaults are the demo run.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Sequence

import yaml

from dockrl.config.config import Config
from dockrl.config.errors import ConfigError, fail
from dockrl.config.explain import explain_error
from dockrl.config.resolve import FROM_AUTO
from dockrl.parallel.layout import LayoutError


def _check_type(where: str, value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin is Annotated and isinstance(registry := typing.get_args(tp)[1], dict):  # a name in a registry (ESTIMATORS)
        if not (isinstance(value, str) and value in registry):
            raise fail(where, value, f"expected one of {', '.join(repr(x) for x in registry)}")
        return value
    if origin is Literal:
        allowed = typing.get_args(tp)
        # by type too: 1 == True, and YAML's 1 is no boolean
        if not any(type(value) is type(a) and value == a for a in allowed):
            raise fail(where, value, f"expected one of {', '.join(repr(x) for x in allowed)}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise fail(where, value, "expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail(where, value, "expected an integer")
        return value
    if tp is float:
        if isinstance(value, str):  # PyYAML reads 1e-5 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise fail(where, value, "expected a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise fail(where, value, "expected a string")
        return value
    if origin is tuple and typing.get_args(tp)[1:] == (Ellipsis,):  # tuple[str, ...]: a YAML list, or comma-separated
        items = [v.strip() for v in value.split(",")] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise fail(where, value, "expected a list of strings (or comma-separated text)")
        return tuple(_check_type(f"{where}[{i}]", v, typing.get_args(tp)[0]) for i, v in enumerate(items))
    if isinstance(tp, types.UnionType):  # e.g. str | float (run.keep_rollouts): the first member type that takes the value
        for member in typing.get_args(tp):
            try:
                return _check_type(where, value, member)
            except ConfigError:
                pass
        raise fail(where, value, f"expected {' or '.join(getattr(m, '__name__', str(m)) for m in typing.get_args(tp))}")
    raise TypeError(f"{where}: unsupported config type {tp}")  # internal: a new field type


def _build(cls: type, values: dict[str, Any], where: str) -> Any:
    if not isinstance(values, dict):
        raise fail(where, values, "expected a mapping of fields")
    hints = typing.get_type_hints(cls, include_extras=True)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names, key=str)  # a YAML key may be a number
    if unknown:
        raise ConfigError(f"{where or 'config'}: unknown field(s) {unknown}; expected some of {sorted(names)}")
    kwargs = {}
    for name, value in values.items():
        tp = hints[name]
        key = f"{where}.{name}" if where else name
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value, key)
        else:
            kwargs[name] = _check_type(key, value, tp)
    try:
        return cls(**kwargs)
    except LayoutError as e:  # the layout checks its own rules, naming each parallel.* field
        raise ConfigError(str(e)) from e


MAX_CONFIG_CHARS = 4 << 20
"""The longest config text, in characters (4 MiB: real ones are a few KiB)."""
MAX_TEXT_CHARS = 1 << 20
"""The longest value of a field, and the longest override, in characters."""
MAX_VALUES = 10_000
"""Values (mappings, lists and scalars) a config may hold in all, each alias counted where it is used."""
MAX_DEPTH = 16
"""Nesting of mappings and lists in a config (sections, nested sections and list fields are 4 deep)."""


def check_bounds(data: Any, source: str) -> None:
    """Refuse a config larger or deeper than any real one before anything else reads it.

    A YAML alias is one node that every use shares: a few hundred bytes of nested aliases ("a billion
    laughs") load as a handful of objects that expand to billions of values once something walks or
    prints them. The walk here counts each use and stops at ``MAX_VALUES``, so such a value costs
    milliseconds.

    Raises:
        ConfigError: more than ``MAX_VALUES`` values, a nesting deeper than ``MAX_DEPTH``, or a text
            value longer than ``MAX_TEXT_CHARS``; the message names the field where the bound was crossed.
    """
    seen = 0
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        seen += 1
        field = where or "config"
        if seen > MAX_VALUES:
            raise ConfigError(f"{source}: {field}: the config holds more than {MAX_VALUES} values (a YAML alias used "
                              "over and over?); a config is at most that large")
        if depth > MAX_DEPTH:
            raise ConfigError(f"{source}: {field}: nested more than {MAX_DEPTH} deep; a config is at most that deep")
        if isinstance(value, dict):
            stack.extend((v, f"{where}.{k}" if where else str(k), depth + 1) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value))
        elif isinstance(value, str) and len(value) > MAX_TEXT_CHARS:
            raise ConfigError(f"{source}: {field}: a text of {len(value)} characters; a value is at most {MAX_TEXT_CHARS}")


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """``["trainer.lr=1e-5", "reward_model.model.path=rm"]`` → nested dict; values parsed as YAML scalars.

    Raises:
        ConfigError: an override that is not ``section.field=value``, one longer than ``MAX_TEXT_CHARS``, or one
            that gives a value to a name an earlier override made a section.
    """
    tree: dict[str, Any] = {}
    for item in overrides:
        if len(item) > MAX_TEXT_CHARS:
            raise ConfigError(f"override {item[:60]!r}...: {len(item)} characters; an override is at most {MAX_TEXT_CHARS}")
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"override {item!r}: expected section.field=value, e.g. trainer.lr=1e-5")
        key, raw = item.split("=", 1)
        section, *path, name = key.split(".")  # reward_model.model.path: a field of a nested section
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        quoted = len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\""
        # anything but a plain scalar, and unquoted text (where YAML would cut a ' #' comment), stays verbatim
        if isinstance(value, (dict, list)) or value is None or (isinstance(value, str) and not quoted):
            value = raw
        node = tree.setdefault(section, {})
        for depth, part in enumerate(path):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):  # an earlier override gave this section a value
                raise ConfigError(f"override {item!r}: {'.'.join([section, *path[:depth + 1]])} was set to {node!r} by an "
                                  "earlier override; a section takes fields, not a value")
        node[name] = value
    return tree


def parse_override_lines(text: str | Sequence[str]) -> list[str]:
    """The ``section.field=value`` overrides of a text, one per line: the pipeline's ``config_overrides``
    parameter, a single text field in the Kubeflow UI. Blanks around a line are stripped; empty lines and
    lines starting with ``#`` are skipped. A JSON list of strings (that parameter's form before it was a
    text) is read as its items, and a list is taken as it is. Each override is then checked by
    ``load_config`` exactly as on the command line (``parse_overrides``).

    Raises:
        ConfigError: a text starting with ``[`` that is not a JSON list of strings.
    """
    if not isinstance(text, str):
        return [str(item) for item in text]
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except ValueError as err:
            raise ConfigError(f"overrides {text[:60]!r}: not a JSON list ({err}); give one section.field=value per line") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ConfigError(f"overrides {text[:60]!r}: a JSON list of section.field=value strings expected")
        return items
    lines = (line.strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def _merge(data: dict[str, Any], fields: dict[str, Any], cls: Any, where: str = "") -> None:
    """Override ``data``'s fields by ``fields`` in place: a section of the dataclass ``cls`` is merged,
    anything else (a field, an unknown name) replaced.

    Raises:
        ConfigError: ``data`` holds something else than a mapping where ``cls`` has a section.
    """
    hints = typing.get_type_hints(cls)
    for name, value in fields.items():
        key = f"{where}.{name}" if where else name
        tp = hints.get(name)
        if isinstance(value, dict) and dataclasses.is_dataclass(tp):
            if not isinstance(data.setdefault(name, {}), dict):
                raise fail(key, data[name], "expected a mapping of fields")
            _merge(data[name], value, tp, key)
        else:
            data[name] = value


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Load and validate a config; ``auto`` fields stay ``auto`` (``resolve_auto`` resolves them).

    Pure: reads ``path`` and nothing of the machine (no device, no torch, no vLLM).

    Args:
        path: YAML file (UTF-8) with any of the sections ``model, data, rollout, algorithm, reward_model,
            trainer, critic, dock, parallel, run``; ``None`` for the defaults (the demo run).
        overrides: ``section.field=value`` strings applied on top.

    Raises:
        ConfigError: unknown section or field, wrong type, value outside the allowed ones,
            or a broken cross-field rule; the message names the field and the value. Also a file
            that is not UTF-8 text (the message names the byte and where it is).
        FileNotFoundError: ``path`` does not exist.
    """
    text, source = "", "defaults"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"config file {p} " + ("is not a regular file" if p.exists() else "does not exist"))
        raw, source = p.read_bytes(), str(p)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            line = raw.count(b"\n", 0, err.start) + 1
            raise ConfigError(f"{p}: not UTF-8 text (byte 0x{raw[err.start]:02x} at position {err.start}, line {line})") from None
    return load_config_text(text, source, overrides)


class _ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses a key repeated in a mapping (plain PyYAML keeps the last)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.prefixes: dict[yaml.Node, str] = {}
        """The dotted path, with its final dot, of each nested mapping's keys (the top mapping's: "")."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        """As ``SafeLoader``'s.

        Raises:
            ConfigError: a key is repeated; the message names its dotted path and both lines.
        """
        prefix = self.prefixes.get(node, "")
        lines: dict[Any, int] = {}  # the line of each key's first occurrence
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: its keys may be given again
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = lines.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: SafeLoader's own error names it
                continue
            if first != key_node.start_mark.line + 1:
                raise ConfigError(f"{prefix}{key}: repeated key (lines {first} and {key_node.start_mark.line + 1}); "
                                  "a mapping holds each key once")
            self.prefixes[value_node] = f"{prefix}{key}."
        return super().construct_mapping(node, deep=deep)


def load_config_text(text: str, source: str, overrides: Sequence[str] = ()) -> Config:
    """``load_config`` from YAML text (a stage pod gets its run's config in an environment variable).

    Args:
        text: the YAML of a config file ("" for the defaults).
        source: where the text came from, for error messages (a file, ``env DOCKRL_CONFIG_YAML``).

    Raises:
        ConfigError: as ``load_config``; also text that is not a YAML mapping of sections, that
            repeats a key of a mapping, or that is larger or deeper than any config (``check_bounds``).
            A message about a value or key of the text starts with
            ``source`` (one naming an overridden field does not); one naming a field the text and the
            overrides leave at its default ends with ``(<field> is the default <value>)``.
    """
    if len(text) > MAX_CONFIG_CHARS:
        raise ConfigError(f"{source}: {len(text)} characters; a config is at most {MAX_CONFIG_CHARS}")
    try:
        data = yaml.load(text, Loader=_ConfigLoader) or {}
    except yaml.MarkedYAMLError as err:  # one line: where, what, and while doing what
        raise ConfigError(f"{source}: not valid YAML: {_yaml_problem(err)}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: not valid YAML: {' '.join(str(err).split())}") from None
    except ConfigError as err:  # a repeated key
        raise ConfigError(f"{source}: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a YAML mapping of sections")
    check_bounds(data, source)
    in_text, overridden = copy.deepcopy(data), parse_overrides(overrides)
    try:
        _merge(data, overridden, Config)
    except ConfigError as err:  # a section of the text that is no mapping
        raise ConfigError(f"{source}: {err}") from None
    try:
        return _build(Config, data, "")
    except ConfigError as err:
        message = explain_error(str(err), source, in_text, overridden)
        if message == str(err):
            raise
        raise ConfigError(message) from None


def _yaml_problem(err: yaml.MarkedYAMLError) -> str:
    """PyYAML's error in one line: ``line L, column C: <problem> (<context> at line L', column C')``."""
    def at(mark: Any) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""

    problem_at, context_at = at(err.problem_mark), at(err.context_mark)
    text = ": ".join(x for x in (problem_at, err.problem or "") if x)
    if err.context:
        text += f" ({err.context}{' at ' + context_at if context_at not in ('', problem_at) else ''})"
    return text


def dump_config(config: Config, *, portable: bool = False) -> str:
    """The config as YAML text (loadable by ``load_config_text``), its ``auto`` fields as they are:
    ``auto`` in a loaded config, this machine's answer in one ``resolve_auto`` returned.

    ``portable``: fields that ``resolve_auto`` resolved (``parallel.device``, ``rollout.dtype``,
    ``trainer.autocast_bf16``, ``rollout.engine``) are written as ``auto`` again, so that a process
    on another machine (a stage pod on a GPU node, launched from a CPU node) resolves them for its
    own device and the packages of its own image.
    """
    data = config.to_dict()
    if portable:
        for section in data:
            for name in getattr(getattr(config, section), FROM_AUTO, ()):
                data[section][name] = "auto"
    return yaml.safe_dump(data, sort_keys=False)


def save_config(config: Config, path: str | Path) -> None:
    """Write the config as YAML (``dump_config``; loadable by ``load_config``): the run writes the resolved one."""
    Path(path).write_text(dump_config(config))
