"""The structured-output fields of a request body to the gRPC ``StructuredOutput``.

Three spellings reach the same constraint: OpenAI's ``response_format`` (``json_object``,
``json_schema``), vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``,
and vLLM's newer ``structured_outputs`` object. A request gives at most one constraint. Whether it
compiles is checked by the gateway's validation, the same for gRPC and HTTP clients.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.openai_api.errors import bad_request
from gateway.openai_api.protocol import SamplingFields
from protos import common_pb2 as cpb


def structured_output(body: SamplingFields) -> cpb.StructuredOutput | None:
    """The one constraint the body asks for, or None; 400 when it asks for several or is malformed."""
    found = [c for c in (_response_format(body), *_guided(body), *_structured_outputs(body)) if c is not None]
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise bad_request(f"give one structured-output constraint, not several ({names})", found[1][0])
    return found[0][1] if found else None


Found = tuple[str, cpb.StructuredOutput] | None


def _response_format(body: SamplingFields) -> Found:
    rf = body.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return "response_format", _constraint("json_object", True)
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise bad_request("`response_format` of type json_schema needs `json_schema.schema`",
                          "response_format.json_schema")
    return "response_format", _constraint("json_schema", rf.json_schema.schema_)


# (field of the body, its name in errors, the constraint's kind): vLLM's guided_* fields, then its
# structured_outputs object.
GUIDED = (("guided_json", "guided_json", "json_schema"), ("guided_regex", "guided_regex", "regex"),
          ("guided_choice", "guided_choice", "choice"), ("guided_grammar", "guided_grammar", "grammar"))
STRUCTURED_OUTPUTS = (("json_", "structured_outputs.json", "json_schema"),
                      ("regex", "structured_outputs.regex", "regex"),
                      ("choice", "structured_outputs.choice", "choice"),
                      ("grammar", "structured_outputs.grammar", "grammar"),
                      ("json_object", "structured_outputs.json_object", "json_object"))


def _guided(body: SamplingFields) -> list[Found]:
    return _fields(body, GUIDED)


def _structured_outputs(body: SamplingFields) -> list[Found]:
    return _fields(body.structured_outputs, STRUCTURED_OUTPUTS) if body.structured_outputs is not None else []


def _fields(source: object, fields: tuple[tuple[str, str, str], ...]) -> list[Found]:
    """The constraints ``source`` sets among ``fields`` (a false ``json_object`` sets none)."""
    out: list[Found] = []
    for attr, name, kind in fields:
        value = getattr(source, attr)
        if value is not None and value is not False:
            out.append((name, _constraint(kind, value)))
    return out


def _constraint(kind: str, value: Any) -> cpb.StructuredOutput:
    if kind == "json_schema":
        return cpb.StructuredOutput(json_schema=_schema_text(value))
    if kind == "choice":
        return cpb.StructuredOutput(choice=cpb.Choices(choices=value))
    if kind == "json_object":
        return cpb.StructuredOutput(json_object=True)
    return cpb.StructuredOutput(**{kind: value})


def _schema_text(schema: dict[str, Any] | str | bool) -> str:
    """A schema given as an object is sent as its JSON text; one given as text is sent as is (the gateway's
    validation says if it is not JSON)."""
    return schema if isinstance(schema, str) else json.dumps(schema)
