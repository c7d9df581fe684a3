"""The rules of a platform's values: Kubernetes quantities, image references, field types.

``Platform`` and ``Toleration`` (``platform.py``) check their fields here when they are built,
so a bad value in a preset, a platform file or the JSON the pipeline hands the train task fails
at once, naming the field.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any, Literal, get_args, get_origin

# an image registry path, tag and digest, and a Kubernetes object name (``Platform``'s image fields)
REGISTRY_PATTERN = re.compile(r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)*$")
TAG_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
DIGEST_PATTERN = re.compile(r"^sha256:[0-9a-f]{64}$")
K8S_NAME_PATTERN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
# a Kubernetes quantity: an integer with an optional unit (``Platform``'s cpu, memory and storage fields)
QUANTITY = re.compile(r"^([0-9]+)(m|Ki|Mi|Gi|Ti)?$")


def quantity_bytes(quantity: str) -> int:
    """Bytes of a memory quantity ``QUANTITY`` accepts (``m``: thousandths)."""
    match = QUANTITY.match(quantity)
    assert match, quantity  # checked by the caller
    unit = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}.get(match.group(2) or "", 0)
    return int(match.group(1)) * unit if unit else int(match.group(1)) // 1000


def scale_quantity(quantity: str, factor: int) -> str:
    """``quantity`` (a Kubernetes quantity: an integer with an optional ``m``, ``Ki``, ``Mi``,
    ``Gi`` or ``Ti`` suffix) times ``factor``, in the same unit (``scale_quantity("96Gi", 8)``
    is ``"768Gi"``).

    Raises:
        ValueError: ``quantity`` is not of that form, or ``factor`` < 1.
    """
    match = QUANTITY.match(quantity)
    if not match or factor < 1:
        raise ValueError(f"quantity {quantity!r} × {factor}: expected an integer with an optional unit m, Ki, Mi, Gi or Ti "
                         "(e.g. '16', '500m', '96Gi') and a factor >= 1")
    return f"{int(match.group(1)) * factor}{match.group(2) or ''}"


def _fits(value: Any, hint: Any) -> bool:
    """``value`` is of the field type ``hint`` (str, int, a Literal, dict[str, str], tuple[X, ...], a dataclass)."""
    origin = get_origin(hint)
    if origin is Literal:
        return value in get_args(hint)
    if origin is dict:
        key, item = get_args(hint)
        return isinstance(value, dict) and all(_fits(k, key) and _fits(v, item) for k, v in value.items())
    if origin is tuple:
        return isinstance(value, tuple) and all(_fits(v, get_args(hint)[0]) for v in value)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def check_field_types(obj: Any, where: str) -> None:
    """Raises ``ValueError`` naming the first field of the dataclass ``obj`` whose value is not of
    its declared type (a platform file's ``devices_per_node: "8"``, ``env: {X: 200}``, ``scheduler: slurm``)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, hint = getattr(obj, f.name), hints[f.name]
        if not _fits(value, hint):
            expected = " or ".join(map(repr, get_args(hint))) if get_origin(hint) is Literal else \
                getattr(hint, "__name__", None) if get_origin(hint) is None else str(hint).replace("dockrl.launch.platform.", "")
            raise ValueError(f"{where}: {f.name}={value!r}; expected {expected}")
