"""The base of every config section: DeepSpeed's JSON values taken strictly.

zcore.config.schema and zcore.config.optimizer build their sections on it, so that
every key refuses a wrong type, a boolean for a number or an integer past
what the native core holds, with an error naming the key.
"""

from __future__ import annotations

from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

# Largest integer any key takes: sizes and counts end up in int64 fields of
# the native core and in products of them, so 2**62 leaves room.
MAX_CONFIG_INT = 2**62


class Section(BaseModel):
    # strict: no coercion (true is not 1, "4" is not 4, 2.0 is not 2);
    # allow_inf_nan: Infinity and NaN (which Python's json accepts) are refused.
    model_config = ConfigDict(
        extra="forbid", populate_by_name=True, frozen=True, strict=True, allow_inf_nan=False
    )

    @field_validator("*", mode="before")
    @classmethod
    def _json_number(cls, v: Any, info: ValidationInfo) -> Any:
        # Every JSON number or boolean passes here, per key, so errors name the
        # key. Strict mode alone is not enough: a bool is an int to Python
        # (and 0 == False matches Literal[False]), and a float key turns 2**70
        # into 1.2e21 before any bound on ints could see it.
        if not isinstance(v, (bool, int, float)):
            return v
        kinds = _plain_types(cls.model_fields[info.field_name].annotation)
        if not kinds & {bool, int, float, str}:
            return v  # a section: pydantic's message says a JSON object is expected
        if isinstance(v, bool):
            if bool not in kinds:
                raise ValueError("a boolean is not allowed here")
            return v
        if bool in kinds and not kinds & {int, float}:
            raise ValueError("a number is not a boolean here; use true or false")
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


def _plain_types(annotation: Any) -> set[Any]:
    if isinstance(annotation, type):
        return {annotation}
    if get_origin(annotation) is Literal:
        return {type(value) for value in get_args(annotation)}
    return {t for arg in get_args(annotation) for t in _plain_types(arg)}
