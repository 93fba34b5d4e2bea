"""OpenAI's ``response_format`` as the JSON Schema the engine constrains to.

``/v1/chat/completions`` (``openai_api._structure``) passes what it returns to
``ModelHub.generate_many(schema=)``. Shapes follow OpenAI's Chat Completions reference: ``{"type": "text"}``, ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {"name": ...,
"schema": {...}, "strict": true}}``.
"""

from __future__ import annotations

from typing import Any

from specstream.errors import InvalidSchemaError, UnsupportedParameterError

#: ``json_object``: any JSON object (OpenAI: "valid JSON"; an object, as its JSON mode produces)
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}


def schema_from_response_format(response_format: Any) -> dict[str, Any] | None:
    """The JSON Schema ``response_format`` asks for, or None for plain text (absent or ``{"type": "text"}``).

    ``strict`` is accepted either way: the constraint is always exact (OpenAI's strict mode).

    Raises:
        UnsupportedParameterError: ``response_format`` is not an object or its ``type`` is unknown
            (message names ``response_format``).
        InvalidSchemaError: ``json_schema`` without an object ``json_schema.schema``.
    """
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise UnsupportedParameterError("response_format must be an object with a string 'type'")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return dict(JSON_OBJECT_SCHEMA)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidSchemaError("response_format.json_schema.schema must be a JSON Schema object")
        return schema
    raise UnsupportedParameterError(f"response_format type {kind!r} is not supported (text, json_object, "
                                    "json_schema)")
