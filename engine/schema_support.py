r"""Which parts of a JSON schema the grammar engine holds generation to.

xgrammar (0.2) builds its grammar from the keywords it implements and skips the others
silently: such a schema compiles, and the output is not held to what it says. A schema with
``"not": {"type": "integer"}`` would get an integer. So schemas that use a skipped keyword, or
a combination it drops part of, are refused, naming where (``unenforced``), rather than answered
with output that may break them. Each rule was checked against xgrammar with a text that breaks
the schema and that it accepted (tests/test_schema_support.py keeps those checks).

Approximations kept, as every grammar engine makes them: ``oneOf`` is taken as ``anyOf`` (a
value matching two branches passes); a ``format`` is a shape, not a calendar (``2024-02-30`` is
a date), and one xgrammar does not know is any string, as JSON Schema's "format as annotation"
allows; a ``maxLength`` of 1000 or more beside a format is not held (pydantic gives every URL
2083); a key written with escapes (``"\u0078"`` for ``"x"``) is not recognized as that property;
and ``\S`` in a pattern also takes a few Unicode spaces.
"""

from __future__ import annotations

import re

import regex  # a user's pattern runs with a time limit here (re has none)

# Skipped wherever they appear ("minContains"/"maxContains" mean nothing without "contains").
SKIPPED = ("not", "uniqueItems", "contains", "dependentRequired", "dependentSchemas", "dependencies")
SKIPPED += ("$dynamicRef", "$recursiveRef")

NO_OPS = (False, {}, [])  # "uniqueItems": false, "dependentRequired": {}, ... assert nothing

# The keywords that constrain a value (JSON Schema's applicator and validation vocabularies):
# any other key only describes it ("title", "example", "x-order", OpenAPI's "nullable", ...).
ASSERTIONS = frozenset(
    """type enum const multipleOf maximum exclusiveMaximum minimum exclusiveMinimum maxLength
    minLength pattern format items prefixItems additionalItems maxItems minItems contains
    uniqueItems properties patternProperties additionalProperties required maxProperties
    minProperties propertyNames dependentRequired dependentSchemas dependencies
    unevaluatedItems unevaluatedProperties allOf anyOf oneOf not if then else $ref""".split()
)
# A node with one of these is built from it alone: every other assertion beside it is skipped,
# except a "type" every value it allows already has.
WHOLE_NODE = ("$ref", "allOf", "anyOf", "oneOf", "enum", "const")

# Keywords that hold for one type of value only. On a node without "type" (or a keyword that
# implies one) xgrammar allows any value and skips them.
FOR_ONE_TYPE = {
    "minLength": "string", "maxLength": "string", "pattern": "string", "format": "string",
    "minimum": "number", "maximum": "number", "exclusiveMinimum": "number", "exclusiveMaximum": "number",
    "multipleOf": "number", "minItems": "array", "maxItems": "array", "required": "object",
    "minProperties": "object", "maxProperties": "object", "patternProperties": "object", "propertyNames": "object",
}  # fmt: skip
IMPLY_A_TYPE = ("properties", "additionalProperties", "items", "prefixItems")
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
LONG_ENOUGH = 1000  # a "maxLength" beside a format from here on is not refused (see _string_problem)
# The formats xgrammar builds a grammar for: beside one, a length limit is skipped.
FORMATS = frozenset(
    """date-time date time duration email hostname ipv4 ipv6 uri uri-reference uuid uri-template
    json-pointer relative-json-pointer""".split()
)
_LOOKAROUND = re.compile(r"(?<!\\)\(\?<?[=!]")  # (?= (?! (?<= (?<!: dropped from a pattern

# Where a schema holds other schemas that the grammar is built from (those under a refused
# keyword, or an "if" without "then"/"else", are never reached).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMAS = (
    "items",
    "additionalItems",
    "additionalProperties",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
)
_MAX_VISITS = 256  # subschemas one type question may read (refs can fan out, or loop)
_PATTERN_TIMEOUT_S = 0.01
_INDEX = re.compile(r"0|[1-9][0-9]{0,8}")


def unenforced(schema: object) -> str | None:
    """What in ``schema`` (parsed JSON) the grammar engine would skip, and where (a JSON
    pointer), or None when it enforces all of it."""
    stack: list[tuple[object, str]] = [(schema, "")]
    refs: dict[str, set[str] | None] = {}  # the types each "$ref" allows, once worked out
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue  # a boolean schema, or a malformed part the schema check reports
        if problem := _node_problem(node, path or "/", schema, refs):
            return problem
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack += [(sub, f"{path}/{_escape(key)}/{_escape(name)}") for name, sub in node[key].items()]
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack += [(sub, f"{path}/{_escape(key)}/{i}") for i, sub in enumerate(node[key])]
        for key in _SCHEMAS:
            sub = node.get(key)
            if isinstance(sub, list):  # "items" as a list (draft 4 tuples)
                stack += [(s, f"{path}/{_escape(key)}/{i}") for i, s in enumerate(sub)]
            elif key in node:
                stack.append((sub, f"{path}/{_escape(key)}"))
    return None


def _node_problem(node: dict, where: str, root: object, refs: dict) -> str | None:
    if "draft-03" in str(node.get("$schema", "")):
        return f"draft-03 schemas (at {where}) are not supported: their keywords are not enforced by the grammar engine"
    skipped = [key for key in SKIPPED if key in node and node[key] not in NO_OPS]
    if "if" in node and ("then" in node or "else" in node):
        skipped.append("if")
    if skipped:
        return f'"{skipped[0]}" (at {where.rstrip("/")}/{_escape(skipped[0])}) is not enforced by the grammar engine'
    ref = node.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        return f'"$ref" to {ref!r} (at {where}): only references by path inside the schema ("#/...") are supported'
    declared = _declared_types(node)
    if declared == set():
        return f'an empty "type" list (at {where}) allows no value, and the grammar engine would allow any'
    for key in WHOLE_NODE:
        if key not in node:
            continue
        beside = sorted(set(node) & ASSERTIONS - {key, "type"})
        if beside:
            return f'{_listed(beside)} beside "{key}" (at {where}) {_verb(beside)} not enforced by the grammar engine'
        if declared is not None and not _within(_types_of(node, root, refs, without_type=True), declared):
            return f'"type" beside "{key}" (at {where}) is not enforced by the grammar engine (it allows other values)'
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return f'"allOf" of more than one schema (at {where}) is not enforced by the grammar engine'
    return _typed_problem(node, where, declared)


def _typed_problem(node: dict, where: str, declared: set[str] | None) -> str | None:
    """The keywords of one type: on a node that has it, what xgrammar drops beside them."""
    if declared is None and not any(key in node for key in (*IMPLY_A_TYPE, *WHOLE_NODE)):
        untyped = [key for key in FOR_ONE_TYPE if key in node]
        if untyped:
            return f'{_listed(untyped)} on a node without "type" (at {where}) {_verb(untyped)} not enforced by the grammar engine'
    if "multipleOf" in node:
        step, bounded = node["multipleOf"], [key for key in BOUNDS if key in node]
        if declared != {"integer"} or not isinstance(step, int) or bounded:
            why = f"beside {_listed(bounded)}" if bounded else "except as a whole number on integers"
            return f'"multipleOf" (at {where}) is not enforced by the grammar engine {why}'
    return _string_problem(node, where) or _object_problem(node, where)


def _string_problem(node: dict, where: str) -> str | None:
    patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
    patterns += list(node["patternProperties"]) if isinstance(node.get("patternProperties"), dict) else []
    if any(_LOOKAROUND.search(p) for p in patterns):
        return f"a lookahead or lookbehind in a pattern (at {where}) is not enforced by the grammar engine"
    if isinstance(node.get("pattern"), str):
        # A minimum length of 1 says nothing a pattern that cannot match "" does not.
        implied = 0 if _matches(node["pattern"], "") else 1
        beside = [key for key in ("maxLength", "format") if key in node]
        beside += ["minLength"] if node.get("minLength", 0) > implied else []
        if beside:
            return f'{_listed(beside)} beside "pattern" (at {where}) {_verb(beside)} not enforced by the grammar engine'
    if isinstance(node.get("format"), str) and node["format"] in FORMATS:
        # A maximum of a thousand or more (pydantic's URLs: 2083) is kept as an approximation.
        if node.get("maxLength", LONG_ENOUGH) < LONG_ENOUGH or node.get("minLength", 0) > 1:
            return f'a length limit beside "format" (at {where}) is not enforced by the grammar engine'
    return None


def _object_problem(node: dict, where: str) -> str | None:
    required, properties = node.get("required"), node.get("properties")
    known = properties if isinstance(properties, dict) else {}
    if isinstance(required, list) and (missing := [n for n in required if isinstance(n, str) and n not in known]):
        return f'"required" names {_listed(missing)} (at {where}), not among "properties": not enforced by the grammar engine'
    closed = node.get("additionalProperties") is False or node.get("unevaluatedProperties") is False
    if "propertyNames" in node and (known or closed):
        beside = "properties" if known else "no additional properties"
        return f'"propertyNames" beside {beside} (at {where}) is not enforced by the grammar engine'
    patterns = node.get("patternProperties")
    if known and isinstance(patterns, dict) and patterns:
        open_rest = any(
            key in node and node[key] is not False for key in ("additionalProperties", "unevaluatedProperties")
        )
        if open_rest:
            return f'"patternProperties" beside "properties" and more properties (at {where}) is not enforced by the grammar engine'
        for name in known:
            if any(_matches(pattern, name) for pattern in patterns):
                return f'property "{name}" (at {where}) also matches "patternProperties": not enforced by the grammar engine'
    return None


def _declared_types(node: dict) -> set[str] | None:
    kind = node.get("type")
    if isinstance(kind, str):
        return {kind}
    return {k for k in kind if isinstance(k, str)} if isinstance(kind, list) else None


def _types_of(
    node: object, root: object, refs: dict, without_type: bool = False, budget: list[int] | None = None
) -> set[str] | None:
    """The JSON types every value ``node`` allows has, where the schema says (None: any, or
    unknown, or more than ``_MAX_VISITS`` subschemas to read to know). ``refs``: what each
    reference allows, worked out once (a reference that loops back allows any)."""
    budget = [_MAX_VISITS] if budget is None else budget
    budget[0] -= 1
    if not isinstance(node, dict) or budget[0] < 0:
        return None
    if not without_type and (declared := _declared_types(node)) is not None:
        return declared
    ref = node.get("$ref")
    if isinstance(ref, str):
        if ref not in refs:
            refs[ref] = None  # while it is worked out: a loop back to it learns nothing
            refs[ref] = _types_of(_resolve(root, ref), root, refs, budget=budget)
        return refs[ref]
    if isinstance(node.get("enum"), list):
        return {_json_type(value) for value in node["enum"]}
    if "const" in node:
        return {_json_type(node["const"])}
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(node.get(key), list) and node[key]:
            branches = [_types_of(branch, root, refs, budget=budget) for branch in node[key]]
            return None if None in branches else set().union(*branches)
    return None


def _within(types: set[str] | None, declared: set[str]) -> bool:
    return types is not None and all(t in declared or (t == "integer" and "number" in declared) for t in types)


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "unknown")


def _resolve(root: object, ref: str) -> object:
    """The subschema ``ref`` ("#" or "#/a/b") points at in ``root``, or None."""
    node = root
    for token in ref[2:].split("/") if ref != "#" else ():
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(token)
        elif isinstance(node, list) and _INDEX.fullmatch(token) and int(token) < len(node):
            node = node[int(token)]
        else:
            return None
    return node


def _matches(pattern: str, name: str) -> bool:
    """Whether ``name`` matches ``pattern``; a pattern that does not compile here, or takes too
    long, counts as matching (the schema is refused rather than trusted)."""
    try:
        return regex.search(pattern, name, timeout=_PATTERN_TIMEOUT_S) is not None
    except (regex.error, TimeoutError, RecursionError, OverflowError, ValueError):
        return True


def _listed(keys: list[str]) -> str:
    return ", ".join(f'"{key}"' for key in keys)


def _verb(keys: list[str]) -> str:
    return "is" if len(keys) == 1 else "are"


def _escape(key: str) -> str:
    """A key as a JSON pointer token (RFC 6901)."""
    return str(key).replace("~", "~0").replace("/", "~1")
