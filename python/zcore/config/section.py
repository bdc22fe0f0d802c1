"""The base of every config section: DeepSpeed's JSON values, taken as
DeepSpeed's models take them and no further.

zcore.config.schema and zcore.config.optimizer build their sections on it, so that
every key takes what DeepSpeed takes (1 and 0 for booleans, 5e8 for an
integer, numbers written as strings, as JSON writes numbers) and refuses, with an error naming the
key, a wrong type, a boolean for a number or an integer past what the native
core holds.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

# Largest integer any key takes: sizes and counts end up in int64 fields of
# the native core and in products of them, so 2**62 leaves room.
MAX_CONFIG_INT = 2**62


class Section(BaseModel):
    # strict: pydantic coerces nothing; the validator below does what
    # DeepSpeed's models do, key by key. allow_inf_nan: Infinity and NaN (which Python's json accepts) are refused.
    model_config = ConfigDict(
        extra="forbid", populate_by_name=True, frozen=True, strict=True, allow_inf_nan=False
    )

    @field_validator("*", mode="before")
    @classmethod
    def _json_number(cls, v: Any, info: ValidationInfo) -> Any:
        # Every JSON number, boolean or string passes here, per key, so errors
        # name the key. pydantic's strict mode alone would refuse what
        # DeepSpeed's (lax) models take, and its lax mode takes too much: a
        # bool is an int to Python (and 0 == False matches Literal[False]),
        # and a float key turns 2**70 into 1.2e21 before any bound on ints
        # could see it.
        if not isinstance(v, (bool, int, float, str)):
            return v
        kinds = _plain_types(cls.model_fields[info.field_name].annotation)
        if not kinds & {bool, int, float, str}:
            return v  # a section: pydantic's message says a JSON object is expected
        if bool in kinds and not kinds & {int, float}:
            # DeepSpeed's models take 1 and 0 (and "true", "yes", ...) for booleans.
            if isinstance(v, str) and str in kinds:
                return v
            read = boolean_of(v)
            if read is None:
                raise ValueError("not a boolean; use true or false (or 1 or 0)")
            return read
        if isinstance(v, str):
            if str in kinds:
                return v
            number = number_in_string(v)
            if number is None:
                return v  # no number: pydantic's message names what is expected
            v = number
        if isinstance(v, bool):
            raise ValueError("a boolean is not allowed here")
        # DeepSpeed configs write sizes as 5e8, which JSON reads as a float:
        # an exact integer is the same value; 2.5 or Infinity stays an error.
        if isinstance(v, float) and v.is_integer() and int in kinds and float not in kinds:
            v = int(v)
        if isinstance(v, int):
            if abs(v) > MAX_CONFIG_INT:
                raise ValueError("must be at most 2**62 in magnitude")
            if float in kinds and int not in kinds and float(v) != v:
                raise ValueError("an integer this large has no exact float value")
        return v


# The strings DeepSpeed's models (pydantic, lax) read as booleans, in any case.
_BOOLEAN_WORDS = {
    **dict.fromkeys(("true", "yes", "on", "t", "y", "1"), True),
    **dict.fromkeys(("false", "no", "off", "f", "n", "0"), False),
}


def boolean_of(v: Any) -> Optional[bool]:
    """``v`` as a boolean where DeepSpeed's models take it for one (true,
    1 or 0, "true", "yes", ...); None where they do not."""
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)) and v in (0, 1):
        return bool(v)
    if isinstance(v, str):
        return _BOOLEAN_WORDS.get(v.lower())
    return None


def number_in_string(v: str) -> Union[int, float, None]:
    """The number a string holds where it is a JSON number ("1000", "5e8",
    "0.5", spaces around allowed), as DeepSpeed configs sometimes write
    numbers; None for any other string."""
    try:
        number = json.loads(v.strip())
    except (ValueError, RecursionError):
        return None
    return number if type(number) in (int, float) else None


def _plain_types(annotation: Any) -> set[Any]:
    if isinstance(annotation, type):
        return {annotation}
    if get_origin(annotation) is Literal:
        return {type(value) for value in get_args(annotation)}
    return {t for arg in get_args(annotation) for t in _plain_types(arg)}
