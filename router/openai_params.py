"""The OpenAI parameters for choices, log probabilities and structured output, read into the
router's ``SamplingRequest`` fields. Their ranges are checked once, by ``request_rules`` (the
same words gRPC clients get); here only their OpenAI shapes are, and the renaming of a refused
field back to the parameter the client sent.

- ``n``, ``best_of`` (completions; ``best_of`` > ``n`` cannot stream, as OpenAI says);
- completions ``logprobs`` (an integer: alternatives per token) and ``echo`` (the prompt
  returned before the completion; with ``logprobs``, with its tokens' logprobs too); vLLM's
  ``prompt_logprobs`` (answered whole, as vLLM does: not with ``stream``);
- chat ``logprobs`` (a boolean) and ``top_logprobs``;
- ``response_format``: ``text``, ``json_object``, ``json_schema`` (``{"json_schema":
  {"name", "schema", "strict"}}``); vLLM's ``structured_outputs`` (``{"json" | "regex" |
  "choice" | "grammar" | "json_object": ...}``, its form since v0.12) and its older
  ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``; at most one of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pdserve.request_rules import Constraint, check_choice_count
from pdserve.router.openai_protocol import Params, by_rule, invalid

GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


@dataclass(frozen=True, slots=True)
class ParityFields:
    sampling: dict[str, Any]  # SamplingRequest fields
    names: dict[str, str] = field(default_factory=dict)  # validation's field -> the client's parameter
    echo: bool = False
    show_prompt_logprobs: bool = False  # vLLM's prompt_logprobs, asked for by name


def parity_fields(p: Params, chat: bool, stream: bool) -> ParityFields:
    sampling: dict[str, Any] = {"n": p.get_int("n")}
    names = {"sampling.n": "n"}
    echo = False
    if chat:
        if p.get_bool("logprobs"):
            sampling["logprobs"] = p.get_int("top_logprobs") or 0
            names["sampling.logprobs"] = "top_logprobs"
        elif p.get_int("top_logprobs"):
            raise invalid("top_logprobs", "requires logprobs: true")
    else:
        sampling["logprobs"] = p.get_int("logprobs")
        names["sampling.logprobs"] = "logprobs"
        echo = p.get_bool("echo")
        best_of = p.get_int("best_of")
        if best_of is not None and stream and best_of > (sampling["n"] or 1):
            raise invalid("best_of", "best_of > n cannot be streamed (the best choices are known only at the end)")
        sampling["best_of"] = best_of
        names["sampling.best_of"] = "best_of"
        if echo and sampling["logprobs"] is not None:  # the prompt's tokens get logprobs too
            sampling["prompt_logprobs"] = sampling["logprobs"]
    asked = p.get_int("prompt_logprobs")  # a vLLM extension
    show_prompt_logprobs = asked is not None
    if show_prompt_logprobs:
        if stream:
            raise invalid("prompt_logprobs", "is not available when stream is true")
        sampling["prompt_logprobs"] = asked
        names["sampling.prompt_logprobs"] = "prompt_logprobs"
    constraint, param = _constraint(p)
    if constraint is not None:
        sampling["constraint"] = constraint
        names.update(
            {
                f"sampling.structured_output.{kind}": param
                for kind in ("json_schema", "json_object", "regex", "choice", "grammar")
            }
        )
        names["sampling.structured_output"] = param
        names["sampling.ignore_eos"] = "ignore_eos"
    return ParityFields({k: v for k, v in sampling.items() if v is not None}, names, echo, show_prompt_logprobs)


def _constraint(p: Params) -> tuple[Constraint | None, str]:
    given = [name for name in ("response_format", "structured_outputs", *GUIDED) if p.given(name)]
    fmt = p.raw("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and isinstance(fmt.get("type"), str)):
        raise invalid("response_format", 'must be an object with a "type": text, json_object or json_schema')
    if fmt is not None and fmt["type"] == "text":
        given.remove("response_format")
    if len(given) > 1:
        raise invalid(given[1], f"give one structured-output constraint (got {' and '.join(given)})")
    if not given:
        return None, ""
    name = given[0]
    value = p.raw(name)
    if name == "response_format":
        kind = value["type"]
        if kind == "json_object":
            return Constraint("json_object"), name
        if kind != "json_schema":
            raise invalid("response_format.type", f"must be text, json_object or json_schema, got {kind!r}")
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise invalid("response_format.json_schema", 'must be an object with a "schema" (and a "name")')
        return Constraint("json_schema", _schema_text(spec["schema"], "response_format.json_schema.schema")), name
    if name == "structured_outputs":
        name, kind, value = _structured_outputs(value)
        if kind == "json_object":
            return Constraint("json_object"), name
    else:
        kind = GUIDED[name]
    if kind == "choice":
        if isinstance(value, list):
            by_rule(check_choice_count, len(value), field=name)  # before walking a list of millions
            if all(isinstance(c, str) for c in value):
                return Constraint("choice", choices=tuple(value)), name
        raise invalid(name, "must be a list of strings")
    if kind == "json_schema":
        return Constraint(kind, _schema_text(value, name)), name
    if not isinstance(value, str):
        raise invalid(name, "must be a string")
    return Constraint(kind, value), name


def _structured_outputs(value: Any) -> tuple[str, str, Any]:
    """vLLM's ``structured_outputs`` object: (the parameter's name, the constraint kind, its
    value). Its other options would change the answer and are not built: refused when set."""
    keys = (*STRUCTURED_OUTPUTS, "json_object")
    if not isinstance(value, dict):
        raise invalid("structured_outputs", f"must be an object with one of {', '.join(keys)}")
    for key, option in value.items():
        if key not in keys and option not in (None, False):
            raise invalid(f"structured_outputs.{key}", "is not supported")
    given = [key for key in keys if value.get(key) not in (None, False)]
    if len(given) != 1:
        raise invalid("structured_outputs", f"give exactly one of {', '.join(keys)} (got {len(given)})")
    key = given[0]
    return f"structured_outputs.{key}", STRUCTURED_OUTPUTS.get(key, "json_object"), value[key]


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):  # vLLM accepts a schema as JSON text too
        return schema
    if not isinstance(schema, (dict, bool)):
        raise invalid(param, "must be a JSON Schema object")
    return json.dumps(schema)
