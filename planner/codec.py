"""Schema-checked encoding of the project's frozen dataclasses to plain data, JSON and msgpack.

Every message that crosses a process boundary (manifests, schedules, control signals) is one of
the dataclasses in `planner.types` or `transfer.protocol`. `to_plain` turns one into nested
lists/dicts of str/int/float/bool/bytes/None; `from_plain` rebuilds it from the type hints and
raises `ValueError` on anything that does not match, so a decoder never executes or constructs
anything the schema does not name. No pickle anywhere.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import sys
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack

T = TypeVar("T")

_MAX_DEPTH = 32


def to_plain(value: Any) -> Any:
    """Convert a dataclass tree into plain data (dataclasses become dicts with their fields)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (str, int, float, bool, bytes)):
        return value
    raise TypeError(f"cannot encode {type(value).__name__}")


@dataclasses.dataclass(frozen=True, slots=True)
class _Field:
    name: str
    hint: Any
    required: bool


@functools.cache
def _schema(cls: type) -> tuple[tuple[_Field, ...], frozenset[str]]:
    """A dataclass's init fields with their resolved type hints, computed once per class:
    resolving string annotations (`typing.get_type_hints`) is about 50 us for a small class,
    which made decoding one control message cost 57 us (the controller decodes one report per
    trainer rank per phase)."""
    module = sys.modules[cls.__module__]
    hints = typing.get_type_hints(cls, vars(module))
    fields = tuple(
        _Field(
            f.name,
            hints[f.name],
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
        )
        for f in dataclasses.fields(cls)
        if f.init
    )
    return fields, frozenset(f.name for f in fields)


def _bool(data: Any, path: str) -> bool:
    if not isinstance(data, bool):
        raise ValueError(f"{path}: expected bool, got {type(data).__name__}")
    return data


def _int(data: Any, path: str) -> int:
    if not isinstance(data, int) or isinstance(data, bool):
        raise ValueError(f"{path}: expected int, got {type(data).__name__}")
    return data


def _float(data: Any, path: str) -> float:
    if isinstance(data, bool) or not isinstance(data, (int, float)):
        raise ValueError(f"{path}: expected number, got {type(data).__name__}")
    return float(data)


def _str(data: Any, path: str) -> str:
    if not isinstance(data, str):
        raise ValueError(f"{path}: expected str, got {type(data).__name__}")
    return data


def _bytes(data: Any, path: str) -> bytes:
    if not isinstance(data, (bytes, bytearray)):
        raise ValueError(f"{path}: expected bytes, got {type(data).__name__}")
    return bytes(data)


_SCALARS: dict[type, Callable[[Any, str], Any]] = {
    bool: _bool,
    int: _int,
    float: _float,
    str: _str,
    bytes: _bytes,
}


def from_plain(cls: type[T], data: Any, *, path: str = "$", depth: int = 0) -> T:
    """Rebuild an instance of `cls` from plain data, checking every field against its type.

    Raises:
        ValueError: the data does not match the schema; the message gives the path.
    """
    return typing.cast(T, _decode(cls, data, path, depth))


def _decode(tp: Any, data: Any, path: str, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise ValueError(f"{path}: nested too deeply")
    scalar = _SCALARS.get(tp) if isinstance(tp, type) else None
    if scalar is not None:
        return scalar(data, path)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return data
    if origin is typing.Union or (hasattr(types, "UnionType") and origin is types.UnionType):
        errors = []
        if data is None and type(None) in args:
            return None
        for arm in args:
            if arm is type(None):
                continue
            try:
                return _decode(arm, data, path, depth + 1)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError(f"{path}: matches no alternative ({'; '.join(errors)})")
    if origin is typing.Literal:
        if data not in args:
            raise ValueError(f"{path}: {data!r} is not one of {args}")
        return data
    if origin in (tuple, list):
        if not isinstance(data, (list, tuple)):
            raise ValueError(f"{path}: expected a list, got {type(data).__name__}")
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            items = [_decode(args[0], v, f"{path}[{i}]", depth + 1) for i, v in enumerate(data)]
            return tuple(items)
        if origin is tuple:
            if len(args) != len(data):
                raise ValueError(f"{path}: expected {len(args)} items, got {len(data)}")
            return tuple(
                _decode(a, v, f"{path}[{i}]", depth + 1)
                for i, (a, v) in enumerate(zip(args, data, strict=True))
            )
        return [_decode(args[0], v, f"{path}[{i}]", depth + 1) for i, v in enumerate(data)]
    if origin is dict:
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a map, got {type(data).__name__}")
        kt, vt = args
        return {
            _decode(kt, k, f"{path}.<key>", depth + 1): _decode(vt, v, f"{path}[{k!r}]", depth + 1)
            for k, v in data.items()
        }
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a map for {tp.__name__}, got {type(data).__name__}")
        fields, names = _schema(tp)
        if not names.issuperset(data):
            unknown = set(data) - names
            raise ValueError(
                f"{path}: unknown field(s) {sorted(map(str, unknown))} for {tp.__name__}"
            )
        kwargs = {}
        for f in fields:
            if f.name not in data:
                if f.required:
                    raise ValueError(f"{path}: missing field {f.name!r} of {tp.__name__}")
                continue
            kwargs[f.name] = _decode(f.hint, data[f.name], f"{path}.{f.name}", depth + 1)
        try:
            return tp(**kwargs)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: invalid {tp.__name__}: {exc}") from exc
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(data)
        except ValueError as exc:
            raise ValueError(f"{path}: {data!r} is not a valid {tp.__name__}") from exc
    if tp is type(None):
        if data is not None:
            raise ValueError(f"{path}: expected null")
        return None
    raise TypeError(f"{path}: unsupported schema type {tp!r}")


def to_msgpack(value: Any) -> bytes:
    """Encode a dataclass tree as msgpack."""
    return typing.cast(bytes, msgpack.packb(to_plain(value), use_bin_type=True))


def from_msgpack(cls: type[T], data: bytes) -> T:
    """Decode msgpack bytes into `cls`, schema-checked.

    Raises:
        ValueError: the bytes are not valid msgpack or do not match the schema.
    """
    try:
        plain = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises many unrelated exception types on garbage
        raise ValueError(f"not valid msgpack: {type(exc).__name__}: {exc}") from exc
    return from_plain(cls, plain)


def to_json(value: Any) -> str:
    """Encode a dataclass tree as canonical JSON (sorted keys, no spaces): same input, same bytes.

    bytes fields are not allowed in JSON documents.
    """
    return json.dumps(to_plain(value), sort_keys=True, separators=(",", ":"))


def from_json(cls: type[T], text: str | bytes) -> T:
    """Decode JSON into `cls`, schema-checked.

    Raises:
        ValueError: not JSON, or not matching the schema.
    """
    try:
        plain = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"not valid JSON: {exc}") from exc
    return from_plain(cls, plain)
