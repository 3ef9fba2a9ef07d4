"""Reading config.json fields with errors that name the file and the field (shared by
`rlfuse.model.config` and the families' own config hooks in `rlfuse.model.arch`)."""

from __future__ import annotations

import math

_MISSING = object()


def number(d: dict, key: str, where: str, default=_MISSING, *, integer: bool = False, label: str | None = None):
    """d[key] as a positive (finite) int or float. Absent: `default` (the HF default, when
    the field has one) or an error; null, zero, negative or a non-number: an error naming
    the field -- never a silent default."""
    label = label or key
    kind = "a positive integer" if integer else "a positive finite number"
    if key not in d:
        if default is _MISSING:
            raise ValueError(f"{where}: missing required field {label!r} (expected {kind})")
        return default
    v = d[key]
    if v is None:
        raise ValueError(f"{where}: field {label!r} is null; expected {kind}")
    ok_type = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok_type or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{where}: field {label!r} is {v!r}; expected {kind}")
    return v if integer else float(v)


def flag(d: dict, key: str, where: str, default: bool) -> bool:
    v = d.get(key, default)
    if not isinstance(v, bool):
        raise ValueError(f"{where}: field {key!r} is {v!r}; expected true or false")
    return v
