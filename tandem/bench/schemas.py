"""JSON schemas of different shapes, with a prompt each: the structured-output tests sample them and
``tandem bench structured`` times them.

Every string has a maxLength and every array a maxItems, so a sampled output is bounded, as a
production schema usually is; the shapes cover nested objects, bounded arrays, enums, numeric ranges,
optional fields, $ref, anyOf, nullable types and patterns.
"""

from __future__ import annotations

from typing import Any

NAME = {"type": "string", "minLength": 1, "maxLength": 16}

SCHEMAS: dict[str, tuple[str, dict[str, Any]]] = {
    "person": ("Describe a person: name, age and home address.", {
        "type": "object",
        "properties": {
            "name": NAME,
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "address": {
                "type": "object",
                "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "address"],
        "additionalProperties": False,
    }),
    "scores": ("List a few test scores between 0 and 99.", {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 99},
        "minItems": 2,
        "maxItems": 5,
    }),
    "shirt": ("Pick a shirt colour and size.", {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L", "XL"]}},
        "required": ["color", "size"],
        "additionalProperties": False,
    }),
    "weather": ("Report today's weather as numbers.", {
        "type": "object",
        "properties": {
            "temperature_c": {"type": "number", "minimum": -50, "maximum": 60},
            "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
            "wind_kmh": {"type": "integer", "exclusiveMinimum": 0, "maximum": 300},
        },
        "required": ["temperature_c", "humidity", "wind_kmh"],
        "additionalProperties": False,
    }),
    "profile": ("Fill in a user profile; the nickname is optional.", {
        "type": "object",
        "properties": {"username": NAME, "nickname": NAME, "verified": {"type": "boolean"}},
        "required": ["username", "verified"],
        "additionalProperties": False,
    }),
    "segment": ("Give a line segment as two points.", {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": -100, "maximum": 100},
                               "y": {"type": "integer", "minimum": -100, "maximum": 100}},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    }),
    "order": ("Write a small shopping order.", {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"product": NAME, "quantity": {"type": "integer", "minimum": 1, "maximum": 9}},
                    "required": ["product", "quantity"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 3,
            },
            "express": {"type": "boolean"},
        },
        "required": ["items", "express"],
        "additionalProperties": False,
    }),
    "shape": ("Describe a circle or a square.", {
        "anyOf": [
            {"type": "object",
             "properties": {"kind": {"const": "circle"}, "radius": {"type": "integer", "minimum": 1, "maximum": 50}},
             "required": ["kind", "radius"], "additionalProperties": False},
            {"type": "object",
             "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1, "maximum": 50}},
             "required": ["kind", "side"], "additionalProperties": False},
        ]
    }),
    "ticket": ("Open a support ticket; the note may be null.", {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "priority": {"type": "integer", "enum": [1, 2, 3]},
            "note": {"type": ["string", "null"], "maxLength": 24},
        },
        "required": ["id", "priority", "note"],
        "additionalProperties": False,
    }),
    "config": ("Write a server configuration.", {
        "type": "object",
        "properties": {
            "server": {
                "type": "object",
                "properties": {
                    "host": NAME,
                    "port": {"type": "integer", "minimum": 1024, "maximum": 65535},
                    "tls": {
                        "type": "object",
                        "properties": {"enabled": {"type": "boolean"}, "version": {"enum": ["1.2", "1.3"]}},
                        "required": ["enabled", "version"],
                        "additionalProperties": False,
                    },
                },
                "required": ["host", "port", "tls"],
                "additionalProperties": False,
            },
            "workers": {"type": "integer", "minimum": 1, "maximum": 64},
        },
        "required": ["server", "workers"],
        "additionalProperties": False,
    }),
    "tags": ("Tag this article with up to four topics.", {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 32},
            "tags": {"type": "array", "items": {"enum": ["science", "sports", "art", "politics", "tech"]},
                     "maxItems": 4},
        },
        "required": ["title", "tags"],
        "additionalProperties": False,
    }),
}
