"""The base of every options model kvtier validates: the configuration's
sections, each tier's, codec's and index's options, the engines' extra config.

A misspelt key is an error, options never change once validated, and each
option's docstring is its documentation. A boolean is refused wherever the
option does not take one: pydantic's lax mode would read ``true`` as ``1``,
and YAML reads ``yes``, ``on`` and ``y`` as ``true``, so ``chunk_tokens: yes``
would otherwise be a one-token chunk.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

__all__ = ["Options"]


class Options(BaseModel):
    """Options of one kind (a section, a tier, a codec): subclass it, declare
    fields with defaults and docstrings."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        if (
            isinstance(value, bool)
            and info.field_name is not None
            and _a_number_not_a_boolean(cls.model_fields[info.field_name].annotation)
        ):
            raise ValueError("expected a number, not a boolean")
        return value


def _a_number_not_a_boolean(annotation: Any) -> bool:
    """Whether a field of this type takes a number but neither ``true`` nor ``false``."""
    kinds = _kinds(annotation)
    return any(kind in (int, float) for kind in kinds) and bool not in kinds


def _kinds(annotation: Any) -> set[Any]:
    """What a field of this type may hold: ``int``, ``float``, ``bool``, or
    anything else as itself (a ``Literal`` by the types of its choices)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _kinds(typing.get_args(annotation)[0])
    if origin is typing.Union or origin is types.UnionType:
        return set().union(*map(_kinds, typing.get_args(annotation)))
    if origin is typing.Literal:
        return {type(choice) for choice in typing.get_args(annotation)}
    if annotation is Any or annotation is object:
        return {bool}
    if isinstance(annotation, type) and annotation is not bool:
        for number in (int, float):
            if issubclass(annotation, number):
                return {number}
    return {annotation}
