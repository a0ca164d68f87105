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
        return "response_format", cpb.StructuredOutput(json_object=True)
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise bad_request("`response_format` of type json_schema needs `json_schema.schema`",
                          "response_format.json_schema")
    return "response_format", cpb.StructuredOutput(json_schema=_schema_text(rf.json_schema.schema_))


def _guided(body: SamplingFields) -> list[Found]:
    out: list[Found] = []
    if body.guided_json is not None:
        out.append(("guided_json", cpb.StructuredOutput(json_schema=_schema_text(body.guided_json))))
    if body.guided_regex is not None:
        out.append(("guided_regex", cpb.StructuredOutput(regex=body.guided_regex)))
    if body.guided_choice is not None:
        out.append(("guided_choice", cpb.StructuredOutput(choice=cpb.Choices(choices=body.guided_choice))))
    if body.guided_grammar is not None:
        out.append(("guided_grammar", cpb.StructuredOutput(grammar=body.guided_grammar)))
    return out


def _structured_outputs(body: SamplingFields) -> list[Found]:
    so = body.structured_outputs
    if so is None:
        return []
    out: list[Found] = []
    if so.json_ is not None:
        out.append(("structured_outputs.json", cpb.StructuredOutput(json_schema=_schema_text(so.json_))))
    if so.regex is not None:
        out.append(("structured_outputs.regex", cpb.StructuredOutput(regex=so.regex)))
    if so.choice is not None:
        out.append(("structured_outputs.choice", cpb.StructuredOutput(choice=cpb.Choices(choices=so.choice))))
    if so.grammar is not None:
        out.append(("structured_outputs.grammar", cpb.StructuredOutput(grammar=so.grammar)))
    if so.json_object:
        out.append(("structured_outputs.json_object", cpb.StructuredOutput(json_object=True)))
    return out


def _schema_text(schema: dict[str, Any] | str | bool) -> str:
    """A schema given as an object is sent as its JSON text; one given as text is sent as is (the gateway's
    validation says if it is not JSON)."""
    return schema if isinstance(schema, str) else json.dumps(schema)
