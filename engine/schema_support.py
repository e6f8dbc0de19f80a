"""Which parts of a JSON schema the grammar engine holds generation to.

xgrammar (0.2) builds its grammar from the keywords it implements and skips the others
silently: such a schema compiles, and the output is not held to what it says. A schema with
``"not": {"type": "integer"}`` would get an integer. So schemas that use a skipped keyword are
refused, naming where (``unenforced``), rather than answered with output that may break them.
Each rule below was checked against xgrammar with a string that breaks it and that it
accepted (tests/test_schema_support.py keeps that check).
"""

from __future__ import annotations

# Skipped wherever they appear.
SKIPPED = (
    "not",
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "if",
    "then",
    "else",
    "$dynamicRef",
    "$recursiveRef",
)
# Keywords that only describe: beside a keyword that takes a whole node (below) they lose nothing.
ANNOTATIONS = frozenset(
    (
        "title",
        "description",
        "default",
        "examples",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
        "$schema",
        "$id",
        "$anchor",
        "$defs",
        "definitions",
        "discriminator",
    )
)
# A node with one of these is built from it alone: any other assertion beside it is skipped
# ("type" beside a list of values says nothing the values do not).
WHOLE_NODE = {"$ref": (), "allOf": (), "anyOf": (), "oneOf": (), "enum": ("type",), "const": ("type",)}
SKIPPED_BESIDE_PATTERN = ("minLength", "maxLength", "format")  # a pattern is all a string node keeps

# Where a schema holds other schemas.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMAS = ("items", "additionalItems", "additionalProperties", "propertyNames", "unevaluatedProperties",
            "unevaluatedItems", "contains", "not", "if", "then", "else")  # fmt: skip


def unenforced(schema: object) -> str | None:
    """What in ``schema`` (parsed JSON) the grammar engine would skip, and where (a JSON
    pointer), or None when it enforces all of it."""
    stack: list[tuple[object, str]] = [(schema, "")]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue  # a boolean schema, or a malformed part the schema check reports
        if problem := _node_problem(node, path):
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


def _node_problem(node: dict, path: str) -> str | None:
    where = path or "/"
    for key in SKIPPED:
        if key in node:
            return f'"{key}" (at {path}/{_escape(key)}) is not enforced by the grammar engine'
    ref = node.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return f'"$ref" to {ref!r} (at {where}): only references inside the schema ("#/...") are supported'
    for key, harmless in WHOLE_NODE.items():
        if key in node and (beside := sorted(set(node) - ANNOTATIONS - {key, *harmless})):
            return f'{_listed(beside)} beside "{key}" (at {where}) {_verb(beside)} not enforced by the grammar engine'
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return f'"allOf" of more than one schema (at {where}) is not enforced by the grammar engine'
    if "pattern" in node and (beside := [key for key in SKIPPED_BESIDE_PATTERN if key in node]):
        return f'{_listed(beside)} beside "pattern" (at {where}) {_verb(beside)} not enforced by the grammar engine'
    return None


def _listed(keys: list[str]) -> str:
    return ", ".join(f'"{key}"' for key in keys)


def _verb(keys: list[str]) -> str:
    return "is" if len(keys) == 1 else "are"


def _escape(key: str) -> str:
    """A key as a JSON pointer token (RFC 6901)."""
    return str(key).replace("~", "~0").replace("/", "~1")
