"""JSON schemas for the structured-output tests: nested objects, arrays, enums, numbers,
required and optional fields. Strings and arrays are bounded so that every output fits a
modest max_tokens."""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 12}
INT = {"type": "integer", "minimum": -999, "maximum": 999}  # bounded: an unbounded integer may run on
NUMBER = {"type": "number", "minimum": 0, "maximum": 1000}
SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]},
    {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
    },
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]},
    {
        "type": "object",
        "properties": {"price": NUMBER, "currency": {"enum": ["EUR", "USD"]}},
        "required": ["price", "currency"],
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {"point": {"type": "object", "properties": {"x": INT, "y": INT}, "required": ["x", "y"]}},
        "required": ["point"],
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": NAME,
                    "address": {
                        "type": "object",
                        "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"],
                    },
                },
                "required": ["name", "address"],
            }
        },
        "required": ["user"],
    },
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "count": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["ok", "count"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "title": NAME,
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
            "rating": {"type": "number", "minimum": 0, "maximum": 10},
        },
        "required": ["title", "year", "rating"],
    },
    {"type": "object", "properties": {"status": {"const": "done"}, "code": INT}, "required": ["status", "code"]},
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {"sku": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
                    "required": ["sku", "qty"],
                },
            }
        },
        "required": ["items"],
    },
    {
        "type": "object",
        "properties": {"value": {"anyOf": [INT, {"type": "string", "maxLength": 8}]}},
        "required": ["value"],
    },
    {
        "type": "object",
        "properties": {"level": {"enum": [1, 2, 3]}, "label": {"enum": ["low", "mid", "high"]}},
        "required": ["level", "label"],
    },
    {
        "type": "object",
        "properties": {
            "matrix": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "minItems": 2,
                    "maxItems": 2,
                },
            }
        },
        "required": ["matrix"],
    },
    {
        "type": "object",
        "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
        "required": ["email"],
    },
    {"type": "object", "properties": {"a": INT, "b": INT, "note": NAME}, "required": ["a", "b"]},
    {
        "type": "object",
        "properties": {"nullable": {"type": ["string", "null"], "maxLength": 8}},
        "required": ["nullable"],
    },
    {
        "type": "object",
        "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 60}, "unit": {"enum": ["C", "F"]}},
        "required": ["temperature", "unit"],
    },
    {
        "type": "object",
        "properties": {"person": {"$ref": "#/$defs/person"}},
        "required": ["person"],
        "$defs": {
            "person": {"type": "object", "properties": {"first": NAME, "last": NAME}, "required": ["first", "last"]}
        },
    },
    {
        "type": "object",
        "properties": {
            "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
            "mode": {"enum": ["fast", "safe"]},
        },
        "required": ["flags", "mode"],
    },
    {"type": "string", "enum": ["yes", "no", "maybe"]},
    {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "meta": {
                "type": "object",
                "properties": {
                    "created": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
                    "active": {"type": "boolean"},
                },
                "required": ["created", "active"],
            },
        },
        "required": ["id", "meta"],
    },
]
