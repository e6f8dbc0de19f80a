r"""Which parts of a JSON schema the grammar engine holds generation to.

xgrammar (0.2) builds its grammar from the keywords it implements and skips the others
silently: such a schema compiles, and the output is not held to what it says. A schema with
``"not": {"type": "integer"}`` would get an integer. So a schema that uses a skipped keyword, or
a combination it drops part of, is refused, naming where (``skipped_part``), rather than
answered with output that may break it. Each rule was checked against xgrammar with a text that
breaks the schema and that it accepted (tests/test_schema_support.py keeps those checks).

Approximations kept, as every grammar engine makes them: ``oneOf`` is taken as ``anyOf`` (a
value matching two branches passes); a ``format`` is a shape, not a calendar (``2024-02-30`` is
a date), and one xgrammar does not know is any string, as JSON Schema's "format as annotation"
allows; a ``maxLength`` of 1000 or more beside a format is not held (pydantic gives every URL
2083); a key written with escapes (``"\u0078"`` for ``"x"``) is not recognized as that property,
and keys that "patternProperties" or "additionalProperties" allow may repeat; and ``\S`` in a
pattern also takes a few Unicode spaces.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field

import regex  # a user's patterns run with a time limit here (re has none)

from pdserve.request_rules import schema_validator

# Skipped wherever they appear, unless their value asserts nothing. ("minContains" and
# "maxContains" mean nothing without "contains"; "then"/"else" nothing without "if".)
SKIPPED = {
    "not": lambda v: False,
    "contains": lambda v: False,
    "uniqueItems": lambda v: v is False,
    "dependentRequired": lambda v: isinstance(v, dict) and not any(v.values()),
    "dependentSchemas": lambda v: v == {},
    "dependencies": lambda v: v == {},
    "$dynamicRef": lambda v: False,
    "$recursiveRef": lambda v: False,
}
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
FOR_ONE_TYPE = """minLength maxLength pattern format minimum maximum exclusiveMinimum exclusiveMaximum
    multipleOf minItems maxItems required minProperties maxProperties patternProperties propertyNames""".split()
IMPLY_A_TYPE = ("properties", "additionalProperties", "items", "prefixItems")
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# The formats xgrammar builds a grammar for: beside one, a length limit is skipped. Some of them
# allow the empty string, so for those even a minimum length of 1 says something.
FORMATS = frozenset(
    """date-time date time duration email hostname ipv4 ipv6 uri uri-reference uuid uri-template
    json-pointer relative-json-pointer""".split()
)
FORMATS_OF_EMPTY = frozenset(("uri-reference", "uri-template", "json-pointer"))
LONG_ENOUGH = 1000  # a "maxLength" beside a format from here on is an approximation (above)
LEGACY_REF_DRAFTS = ("Draft4Validator", "Draft6Validator", "Draft7Validator")

CHECK_TIME_S = 2.0  # for one schema, its patterns included: past that it is refused
MAX_VISITS = 20_000  # subschemas one schema's type questions may read
MAX_REF_CHAIN = 200  # references followed one from another to learn a type
MAX_STEP = 1024  # xgrammar takes a "multipleOf" up to this
_INDEX = re.compile(r"0|[1-9][0-9]{0,8}")

# Where a schema holds the subschemas its grammar is built from. ("$defs" are reached through
# the references to them; what sits under a refused keyword is never reached.)
_SCHEMA_MAPS = ("properties", "patternProperties")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMAS = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties", "unevaluatedItems")


def skipped_part(schema: object) -> str | None:
    """What in ``schema`` (parsed JSON) the grammar engine would skip, and where (a JSON
    pointer fragment, ``#/properties/a``), or None when it enforces all of it. Raises
    ``CheckTooCostly`` past ``CHECK_TIME_S`` or ``MAX_VISITS`` (an answer that depends on the
    machine's load, so not one to remember)."""
    check = _Check(schema)
    if check.draft == "Draft3Validator":
        return "draft-03 schemas are not supported: their keywords are not enforced by the grammar engine"
    return check.walk()


class CheckTooCostly(Exception):
    def __init__(self) -> None:
        super().__init__(f"the schema takes more than {CHECK_TIME_S} s or {MAX_VISITS} subschemas to check")


@dataclass
class _Check:
    root: object
    deadline: float = field(default_factory=lambda: time.monotonic() + CHECK_TIME_S)
    visits_left: int = MAX_VISITS
    ref_types: dict[str, set[str] | None] = field(default_factory=dict)  # each reference's, once known
    draft: str = field(init=False)  # the draft jsonschema reads the schema as ("Draft7Validator", ...)

    def __post_init__(self) -> None:
        self.draft = schema_validator(self.root).__name__ if isinstance(self.root, dict) else ""

    @property
    def legacy_ref(self) -> bool:
        """Drafts 4-7, where keywords beside "$ref" mean nothing (the spec ignores them, as xgrammar does)."""
        return self.draft in LEGACY_REF_DRAFTS

    def walk(self) -> str | None:
        # (subschema, its pointer, the type its place implies: property names are strings)
        stack: list[tuple[object, str, str | None]] = [(self.root, "", None)]
        reached = {""}
        while stack:
            node, path, implied = stack.pop()
            self._visit()
            if not isinstance(node, dict):
                continue  # a boolean schema, or a malformed part the schema check reports
            if problem := self._node_problem(node, "#" + path, implied):
                return problem
            ref = node.get("$ref")
            if isinstance(ref, str) and ref[1:] not in reached:  # a target is checked once, where it is
                reached.add(ref[1:])
                stack.append((_resolve(self.root, ref), ref[1:], None))
            if isinstance(ref, str) and self.legacy_ref:
                continue  # the rest of the node means nothing
            for key in _SCHEMA_MAPS:
                if isinstance(node.get(key), dict):
                    stack += [(sub, f"{path}/{key}/{_escape(name)}", None) for name, sub in node[key].items()]
            for key in _SCHEMA_LISTS:
                if isinstance(node.get(key), list):
                    stack += [(sub, f"{path}/{key}/{i}", None) for i, sub in enumerate(node[key])]
            for key in _SCHEMAS:
                sub = node.get(key)
                if isinstance(sub, list):  # "items" as a list (draft 4 tuples)
                    stack += [(s, f"{path}/{key}/{i}", None) for i, s in enumerate(sub)]
                elif key in node:
                    stack.append((sub, f"{path}/{key}", None))
            if "propertyNames" in node:
                stack.append((node["propertyNames"], f"{path}/propertyNames", "string"))
        return None

    def _visit(self) -> None:
        self.visits_left -= 1
        if self.visits_left < 0 or time.monotonic() > self.deadline:
            raise CheckTooCostly

    # -- the rules, in the order a refusal names the first -------------------------------------------
    def _node_problem(self, node: dict, where: str, implied: str | None) -> str | None:
        ref = node.get("$ref")
        if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
            return f'"$ref" to {ref!r} (at {where}/$ref): only references by path inside the schema ("#/...") are supported'
        id_key = "id" if self.draft == "Draft4Validator" else "$id"
        if where != "#" and isinstance(node.get(id_key), str):
            return (
                f'"{id_key}" below the root (at {where}) is not supported: references inside it would resolve elsewhere'
            )
        if implied == "string" and not self._names_strings(node):
            return f'"propertyNames" (at {where}) is not enforced by the grammar engine unless it is a string schema'
        if isinstance(ref, str) and self.legacy_ref:
            return None  # drafts 4-7: nothing beside "$ref" counts
        skipped = [key for key, asserts_nothing in SKIPPED.items() if key in node and not asserts_nothing(node[key])]
        skipped += ["if"] if "if" in node and ("then" in node or "else" in node) else []
        if skipped:
            return _refusal(f'"{skipped[0]}"', f"{where}/{_escape(skipped[0])}")
        declared = _declared_types(node)
        if declared == set():
            return f'an empty "type" list (at {where}) allows no value, and the grammar engine would allow any'
        for key in WHOLE_NODE:
            if key not in node:
                continue
            beside = sorted(set(node) & ASSERTIONS - {key, "type"})
            if beside:
                return _refusal(f'{_listed(beside)} beside "{key}"', where, plural=len(beside) > 1)
            if declared is not None and not _within(self._types_of(node, without_type=True), declared):
                return _refusal(f'"type" beside "{key}"', where) + " (it allows other values)"
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            return _refusal('"allOf" of more than one schema', where)
        declared = declared if declared is not None else ({implied} if implied else None)
        if declared is None and not any(key in node for key in (*IMPLY_A_TYPE, *WHOLE_NODE)):
            untyped = [key for key in FOR_ONE_TYPE if key in node]
            if untyped:
                return _refusal(f'{_listed(untyped)} on a node without "type"', where, plural=len(untyped) > 1)
        return (
            _number_problem(node, where, declared)
            or self._string_problem(node, where)
            or self._object_problem(node, where)
        )

    def _string_problem(self, node: dict, where: str) -> str | None:
        for key in ("minLength", "maxLength"):  # unchecked where a draft does not look ("$defs" in draft 7)
            if key in node and (isinstance(node[key], bool) or not isinstance(node[key], (int, float))):
                return f'"{key}" (at {where}) must be a number'
        patterns = [("pattern", node["pattern"])] if isinstance(node.get("pattern"), str) else []
        if isinstance(node.get("patternProperties"), dict):
            patterns += [("patternProperties", p) for p in node["patternProperties"]]
        for key, pattern in patterns:
            if issue := _pattern_issue(pattern):
                return f"{issue} in {json.dumps(pattern)} (at {where}/{key}) is not enforced by the grammar engine"
        if isinstance(node.get("pattern"), str):
            implied = 0 if self._matches(node["pattern"], "") else 1  # a pattern that cannot match "" says 1
            beside = [key for key in ("maxLength", "format") if key in node]
            beside += ["minLength"] if node.get("minLength", 0) > implied else []
            if beside:
                return _refusal(f'{_listed(beside)} beside "pattern"', where, plural=len(beside) > 1)
        kind = node.get("format")
        if isinstance(kind, str) and kind in FORMATS:
            implied = 0 if kind in FORMATS_OF_EMPTY else 1
            if node.get("maxLength", LONG_ENOUGH) < LONG_ENOUGH or node.get("minLength", 0) > implied:
                return _refusal('a length limit beside "format"', where)
        return None

    def _object_problem(self, node: dict, where: str) -> str | None:
        required, properties = node.get("required"), node.get("properties")
        known = properties if isinstance(properties, dict) else {}
        if isinstance(required, list) and (missing := [n for n in required if isinstance(n, str) and n not in known]):
            return f'"required" names {_listed(missing)} (at {where}) that are not among "properties": not enforced by the grammar engine'
        closed = node.get("additionalProperties") is False or node.get("unevaluatedProperties") is False
        if "propertyNames" in node and (known or closed):
            return _refusal(f'"propertyNames" beside {"properties" if known else "no additional properties"}', where)
        patterns = node.get("patternProperties")
        if known and isinstance(patterns, dict) and patterns:
            rest = ("additionalProperties", "unevaluatedProperties")
            if any(key in node and node[key] is not False for key in rest):
                return _refusal('"patternProperties" beside "properties" and more properties', where)
            for name in known:
                if any(self._matches(pattern, name) for pattern in patterns):
                    return f'property {json.dumps(name)} (at {where}) also matches "patternProperties", which the grammar engine then does not enforce'
        return None

    # -- what the rules ask ---------------------------------------------------------------------------
    def _types_of(self, node: object, without_type: bool = False, depth: int = 0) -> set[str] | None:
        """The JSON types every value ``node`` allows has, where the schema says (None: any, or unknown)."""
        self._visit()
        if depth > MAX_REF_CHAIN:
            raise CheckTooCostly
        if not isinstance(node, dict):
            return None
        if not without_type and (declared := _declared_types(node)) is not None:
            return declared
        ref = node.get("$ref")
        if isinstance(ref, str):
            if ref not in self.ref_types:
                self.ref_types[ref] = None  # while it is worked out: a loop back to it learns nothing
                self.ref_types[ref] = self._types_of(_resolve(self.root, ref), depth=depth + 1)
            return self.ref_types[ref]
        if isinstance(node.get("enum"), list):
            return {_json_type(value) for value in node["enum"]}
        if "const" in node:
            return {_json_type(node["const"])}
        for key in ("anyOf", "oneOf", "allOf"):
            if isinstance(node.get(key), list) and node[key]:
                branches = [self._types_of(branch, depth=depth + 1) for branch in node[key]]
                return None if None in branches else set().union(*branches)
        return None

    def _names_strings(self, node: dict) -> bool:
        """Whether a "propertyNames" schema allows only strings, as xgrammar needs to write keys
        (else it writes bare ones: ``{1: 2}``)."""
        if self._types_of(node) == {"string"}:
            return True
        plain = not any(key in node for key in WHOLE_NODE)
        return plain and any(key in node for key in ("minLength", "maxLength", "pattern", "format"))

    def _matches(self, pattern: str, name: str) -> bool:
        """Whether ``name`` matches ``pattern``. A pattern that does not compile here counts as
        matching (the schema is refused rather than trusted); one that runs out the check's time
        refuses the schema."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise CheckTooCostly
        try:
            return regex.search(pattern, name, timeout=left, concurrent=True) is not None
        except TimeoutError:
            raise CheckTooCostly from None
        except (regex.error, RecursionError, OverflowError, ValueError):
            return True


def _pattern_issue(pattern: str) -> str | None:
    """What of ``pattern`` xgrammar drops: a lookaround, or an anchor inside it (``^a$b``; an
    anchor at the start or end of a branch is kept)."""
    i, in_class, branch_start = 0, False, True
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            i, branch_start = i + 2, False
            continue
        if in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class, branch_start = True, False
        elif ch == "(":
            if pattern.startswith(("(?=", "(?!", "(?<=", "(?<!"), i):
                return "a lookahead or lookbehind"
            i += 3 if pattern.startswith("(?:", i) else 1
            branch_start = True
            continue
        elif ch == "|":
            branch_start = True
        elif ch == "^" and not branch_start:
            return 'an anchor "^" inside the pattern'
        elif ch == "$" and pattern[i + 1 : i + 2] not in ("", ")", "|"):
            return 'an anchor "$" inside the pattern'
        elif ch != "^":
            branch_start = False
        i += 1
    return None


def _number_problem(node: dict, where: str, declared: set[str] | None) -> str | None:
    if "multipleOf" not in node:
        return None
    step, bounded = node["multipleOf"], [key for key in BOUNDS if key in node]
    whole = (isinstance(step, int) or (isinstance(step, float) and step.is_integer())) and step <= MAX_STEP
    if bounded:
        return _refusal(f'"multipleOf" beside {_listed(bounded)}', where)
    if declared is None or declared - {"null"} != {"integer"} or not whole:
        return _refusal('"multipleOf"', where) + f" except as a whole number up to {MAX_STEP} on integers"
    return None


def _refusal(what: str, where: str, plural: bool = False) -> str:
    return f"{what} (at {where}) {'are' if plural else 'is'} not enforced by the grammar engine"


def _declared_types(node: dict) -> set[str] | None:
    kind = node.get("type")
    if isinstance(kind, str):
        return {kind}
    return {k for k in kind if isinstance(k, str)} if isinstance(kind, list) else None


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


def _listed(keys: list[str]) -> str:
    return ", ".join(f'"{key}"' for key in keys)


def _escape(key: str) -> str:
    """A key as a JSON pointer token (RFC 6901)."""
    return str(key).replace("~", "~0").replace("/", "~1")
