"""JSON schemas the grammar engine would not hold generation to are refused, naming where;
everything it enforces passes. Each refusal is backed by a check that xgrammar really accepts
output breaking that schema."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine import structured_output
from pdserve.engine.schema_support import CHECK_TIME_S, CheckTooCostly, skipped_part

INT = {"type": "integer"}
PAIR = {"a": INT, "b": INT}

# (schema, a complete JSON text that breaks it, what the refusal names)
SKIPPED_BY_XGRAMMAR = [
    ({"type": "integer", "not": {"const": 3}}, "3", '"not" (at #/not)'),
    ({"type": "array", "items": INT, "uniqueItems": True}, "[1, 1]", '"uniqueItems"'),
    ({"type": "array", "items": INT, "contains": {"const": 5}}, "[1]", '"contains"'),
    ({"type": "object", "properties": PAIR, "dependentRequired": {"a": ["b"]}}, '{"a": 1}', '"dependentRequired"'),
    (
        {"type": "object", "properties": PAIR, "dependentSchemas": {"a": {"required": ["b"]}}},
        '{"a": 1}',
        '"dependentSchemas"',
    ),
    ({"type": "object", "properties": PAIR, "dependencies": {"a": ["b"]}}, '{"a": 1}', '"dependencies"'),
    (
        {"type": "object", "properties": PAIR, "if": {"required": ["a"]}, "then": {"required": ["b"]}},
        '{"a": 1}',
        '"if"',
    ),
    ({"allOf": [INT, {"minimum": 5}]}, "4", '"allOf" of more than one schema'),
    ({"type": "integer", "allOf": [{"minimum": 5}]}, "4", '"type" beside "allOf"'),
    (
        {"$defs": {"x": {"type": "integer", "minimum": 5}}, "$ref": "#/$defs/x", "maximum": 7},
        "8",
        '"maximum" beside "$ref"',
    ),
    ({"type": "integer", "anyOf": [{"minimum": 5}, {"maximum": -5}]}, "0", '"type" beside "anyOf"'),
    ({"type": "integer", "oneOf": [{"minimum": 5}, {"maximum": -5}]}, "0", '"type" beside "oneOf"'),
    ({"type": "string", "enum": ["a", "bbb"], "minLength": 2}, '"a"', '"minLength" beside "enum"'),
    ({"type": "string", "pattern": "^a*$", "minLength": 2}, '"a"', '"minLength" beside "pattern"'),
    ({"type": "string", "pattern": "^a*$", "maxLength": 2}, '"aaa"', '"maxLength" beside "pattern"'),
    ({"$ref": "http://example.com/x.json"}, '"anything"', "only references by path inside the schema"),
    (
        {"$defs": {"x": {"$anchor": "f", "type": "integer"}}, "type": "object", "properties": {"a": {"$ref": "#f"}}},
        '{"a": "s"}',
        "only references by path",
    ),
    ({"type": "number", "multipleOf": 0.5}, "0.3", '"multipleOf" (at #)'),
    ({"type": "integer", "multipleOf": 5, "minimum": 0}, "3", 'beside "minimum"'),
    ({"type": "string", "format": "email", "minLength": 10}, '"a@b.co"', 'length limit beside "format"'),
    ({"type": "string", "format": "uri", "maxLength": 20}, json.dumps("http://x.com/" + "a" * 30), "length limit"),
    ({"type": "string", "pattern": "^(?=.*\\d).{3,}$"}, '"abc"', "lookahead"),
    ({"type": "object", "properties": {"a": {"title": "A", "maxLength": 3}}}, '{"a": "abcd"}', 'without "type"'),
    ({"minimum": 2}, "1", '"minimum" on a node without "type"'),
    ({"type": "object", "properties": {"a": INT}, "required": ["z"]}, '{"a": 1}', '"required" names "z"'),
    (
        {"type": "object", "properties": {"xa": {"type": "string"}}, "patternProperties": {"^x": {"maxLength": 2}}},
        '{"xa": "abcd"}',
        'property "xa"',
    ),
    ({"type": "string", "enum": ["a", 1]}, "1", '"type" beside "enum"'),
    ({"type": []}, "1", 'an empty "type" list'),
    ({"type": "integer", "not": {}}, "3", '"not" (at #/not)'),  # allows no value at all
    ({"type": "array", "items": INT, "contains": {}}, "[]", '"contains"'),  # at least one item
    (
        {
            "type": "object",
            "properties": {"a": {"$ref": "#/components/schemas/A"}},
            "components": {"schemas": {"A": {"type": "array", "items": INT, "uniqueItems": True}}},
        },
        '{"a": [1, 1]}',
        "(at #/components/schemas/A/uniqueItems)",
    ),  # checked where a reference leads
    (
        {"type": "object", "properties": {"": {"type": "integer", "not": {"const": 1}}}},
        '{"": 1}',
        "(at #/properties//not)",
    ),
    ({"type": "string", "format": "json-pointer", "minLength": 1}, '""', 'length limit beside "format"'),
    # property names that may be other than strings: xgrammar writes them bare, not even JSON
    (
        {"type": "object", "additionalProperties": INT, "propertyNames": {"enum": [1, "a"]}},
        "{1: 2}",
        '"propertyNames" (at #/propertyNames)',
    ),
    ({"type": "object", "additionalProperties": INT, "propertyNames": {"title": "k"}}, "{1: 2}", '"propertyNames"'),
    ({"type": "integer", "multipleOf": 1025}, "3", "up to 1024"),
    # an unknown "$schema" is read as 2020-12, where "maximum" beside "$ref" counts
    (
        {"$schema": "https://example.com/draft-07/x", "$ref": "#/$defs/x", "$defs": {"x": INT}, "maximum": 3},
        "5",
        '"maximum" beside "$ref"',
    ),
    (
        {
            "$ref": "#/$defs/s",
            "$defs": {
                "t": INT,
                "s": {"$id": "http://e.com/s", "$ref": "#/$defs/t", "$defs": {"t": {"type": "string"}}},
            },
        },
        "1",
        '"$id" below the root',
    ),
    ({"type": "string", "pattern": "^a$b"}, '"ab"', 'an anchor "$" inside the pattern in "^a$b" (at #/pattern)'),
    ({"type": "string", "pattern": "b^"}, '"b"', 'an anchor "^" inside the pattern'),
    (
        {"type": "object", "properties": {"abc": INT}, "propertyNames": {"type": "string", "maxLength": 2}},
        '{"abc": 1}',
        '"propertyNames" beside properties',
    ),
    (
        {"type": "object", "additionalProperties": False, "propertyNames": {"enum": ["a", "b"]}},
        '{"a": 1}',
        '"propertyNames" beside no additional properties',
    ),
    (
        {"type": "object", "properties": {"b": INT}, "patternProperties": {"^q$": INT}, "additionalProperties": True},
        '{"q": "s"}',
        '"patternProperties" beside "properties" and more properties',
    ),
    ({"$schema": "http://json-schema.org/draft-03/schema#", "type": "integer", "divisibleBy": 3}, "4", "draft-03"),
]


@pytest.fixture(scope="module")
def compiler():
    import xgrammar as xgr  # a dependency of pdserve: missing is a failure, not a skip

    return xgr, xgr.GrammarCompiler(xgr.TokenizerInfo(["</s>"], stop_token_ids=[0]), max_threads=1)


def accepts_whole(compiler, schema: dict, text: str) -> bool:
    """Whether xgrammar takes ``text`` as a whole output of ``schema`` (as the engine compiles it)."""
    xgr, grammars = compiler
    matcher = xgr.GrammarMatcher(grammars.compile_json_schema(json.dumps(schema), any_whitespace=False))
    return matcher.accept_string(text) and matcher.accept_token(0)  # 0: the stop token


@pytest.mark.parametrize("schema, breaking, named", SKIPPED_BY_XGRAMMAR, ids=[c[2] for c in SKIPPED_BY_XGRAMMAR])
def test_what_xgrammar_skips_is_refused_naming_it(compiler, schema, breaking, named):
    assert accepts_whole(compiler, schema, breaking), "xgrammar enforces this now: allow it in schema_support"
    problem = skipped_part(schema)
    assert problem is not None and named in problem, problem


@pytest.mark.parametrize(
    "schema, breaking, keeping",
    [
        ({"type": "integer", "minimum": 5}, "4", "6"),
        ({"type": "string", "minLength": 2, "maxLength": 3}, '"a"', '"ab"'),
        ({"type": "string", "pattern": "^a+$"}, '"b"', '"aa"'),
        ({"type": "array", "items": INT, "minItems": 2}, "[1]", "[1, 2]"),
        ({"type": "object", "properties": PAIR, "required": ["a", "b"]}, '{"a": 1}', '{"a": 1, "b": 2}'),
        ({"anyOf": [INT, {"type": "null"}], "default": None, "title": "Maybe"}, '"s"', "null"),
        ({"allOf": [{"$ref": "#/$defs/x"}], "description": "one", "$defs": {"x": INT}}, '"s"', "3"),
        ({"type": "string", "enum": ["red", "blue"]}, '"green"', '"red"'),
        # keys outside the validation vocabulary only describe, wherever they are
        ({"anyOf": [INT, {"type": "null"}], "example": 3, "x-order": 1, "nullable": True}, '"s"', "3"),
        # a "type" every branch already has
        (
            {
                "$defs": {"p": {"type": "object", "properties": {"a": INT}, "required": ["a"]}},
                "type": "object",
                "oneOf": [{"$ref": "#/$defs/p"}, {"type": "object", "properties": {"b": INT}, "required": ["b"]}],
            },
            '{"c": 1}',
            '{"a": 1}',
        ),
        ({"type": "array", "items": INT, "minContains": 2}, '["s"]', "[1, 2]"),  # no "contains": no effect
        ({"type": "integer", "if": {"minimum": 3}}, '"s"', "1"),  # no "then"/"else": no effect
        ({"type": "integer", "multipleOf": 3}, "4", "6"),
        ({"type": "string", "format": "uri", "minLength": 1}, '"a b"', '"http://x.org/"'),
        ({"type": "array", "items": INT, "uniqueItems": False}, '["s"]', "[1, 1]"),  # asserts nothing
        ({"type": "string", "minLength": 1, "pattern": "^[a-z]+$"}, '""', '"ab"'),  # the pattern says it already
        ({"type": "object", "additionalProperties": INT, "propertyNames": {"maxLength": 1}}, '{"ab": 1}', '{"a": 1}'),
        ({"type": ["integer", "null"], "multipleOf": 5.0}, "4", "5"),
        ({"type": "object", "properties": PAIR, "dependentRequired": {"a": []}}, '{"a": "s"}', '{"a": 1}'),
        # draft-07: keywords beside "$ref" mean nothing, so dropping them is the spec
        (
            {
                "$schema": "http://json-schema.org/draft-07/schema#",
                "$ref": "#/definitions/x",
                "definitions": {"x": INT},
                "maximum": 3,
            },
            '"s"',
            "5",
        ),
        ({"type": "integer", "$defs": {"unused": {"not": {}}}}, '"s"', "1"),  # never reached: never built
        ({"type": "string", "pattern": "^a$|^(b$|c)$"}, '"ab"', '"b"'),  # anchors that end or start a branch
        ({"type": "string", "pattern": "[$^]x\\$"}, '"yx$"', '"^x$"'),  # in a class, or escaped: characters
        ({"type": "integer", "multipleOf": 1024}, "1025", "2048"),
        # drafts 4-7: what sits beside "$ref" means nothing, to the spec and to xgrammar
        (
            {
                "$schema": "http://json-schema.org/draft-07/schema#",
                "definitions": {"x": INT},
                "type": "object",
                "properties": {"p": {"$ref": "#/definitions/x", "not": {"const": 1}}},
                "required": ["p"],
            },
            '{"p": "s"}',
            '{"p": 1}',
        ),
        # pydantic's HttpUrl: a limit of 2083 beside a format is kept as an approximation (README)
        ({"type": "string", "format": "uri", "minLength": 1, "maxLength": 2083}, '"a b"', '"http://x.org/"'),
    ],
)
def test_what_xgrammar_enforces_passes(compiler, schema, breaking, keeping):
    assert skipped_part(schema) is None
    assert not accepts_whole(compiler, schema, breaking) and accepts_whole(compiler, schema, keeping)


def test_only_schema_positions_count_and_the_pointer_is_exact():
    named_like_keywords = {
        "type": "object",
        "properties": {"not": INT, "if": INT, "contains": {"type": "object", "enum": [{"not": 1}]}},
        "required": ["not"],
        "examples": [{"not": 1, "uniqueItems": True}],
    }
    assert skipped_part(named_like_keywords) is None
    assert skipped_part(True) is None and skipped_part({}) is None
    unlooked = {"$schema": "http://json-schema.org/draft-07/schema#", "$ref": "#/$defs/a"}  # draft 7 skips "$defs"
    unlooked["$defs"] = {"a": {"type": "string", "pattern": "a", "minLength": "x"}}
    assert skipped_part(unlooked) == '"minLength" (at #/$defs/a) must be a number'
    nested = {"properties": {"a/b~c": {"type": "array", "items": [INT, {"type": "array", "uniqueItems": True}]}}}
    assert (
        skipped_part(nested)
        == '"uniqueItems" (at #/properties/a~1b~0c/items/1/uniqueItems) is not enforced by the grammar engine'
    )
    deep = {
        "$ref": "#/$defs/node",
        "$defs": {"node": {"type": "object", "properties": {"next": {"not": {"type": "null"}}}}},
    }
    assert skipped_part(deep) == '"not" (at #/$defs/node/properties/next/not) is not enforced by the grammar engine'
    assert skipped_part({"type": "string", "pattern": "a", "minLength": 2, "format": "email"}) == (
        '"format", "minLength" beside "pattern" (at #) are not enforced by the grammar engine'
    )


# -- any schema the schema check passes gets an answer, never an exception ---------------------------
KEYWORDS = sorted(
    {"type", "enum", "const", "multipleOf", "minimum", "maximum", "exclusiveMinimum", "minLength", "maxLength"}
    | {"pattern", "format", "items", "prefixItems", "minItems", "properties", "patternProperties", "required"}
    | {"additionalProperties", "propertyNames", "allOf", "anyOf", "oneOf", "not", "if", "then", "$ref", "$defs"}
    | {"minProperties", "title", "x-extra", "contains", "minContains", "unevaluatedProperties"}
)
VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-5, 5)
    | st.floats(-3, 3, allow_nan=False)
    | st.sampled_from(
        ["string", "integer", "number", "object", "array", "null", "#", "#/$defs/a", "#a", "^a(?=b)", "[", "a/b~c"]
    ),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(KEYWORDS + ["a", "b"]), inner, max_size=4)
    ),
    max_leaves=12,
)
DRAFTS = st.sampled_from(
    [None, "http://json-schema.org/draft-04/schema#", "http://json-schema.org/draft-07/schema#",
     "https://json-schema.org/draft/2020-12/schema"]
)  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(schema=st.dictionaries(st.sampled_from(KEYWORDS), VALUES, max_size=5), draft=DRAFTS)
def test_every_valid_schema_gets_an_answer(schema, draft):
    from jsonschema import SchemaError, validators

    if draft:
        schema = {**schema, "$schema": draft}
    try:
        validators.validator_for(schema).check_schema(schema)
    except SchemaError:
        return  # refused before this check runs
    assert skipped_part(schema) is None or isinstance(skipped_part(schema), str)


def test_patterns_python_cannot_read_are_refused_by_the_schema_check():
    from pdserve.request_rules import Constraint, InvalidRequest, check_constraint

    for pattern in ("a{99999999999}", "(" * 2000 + "x" + ")" * 2000):
        schema = json.dumps({"type": "string", "pattern": pattern})
        with pytest.raises(
            InvalidRequest, match=r"^sampling\.structured_output\.json_schema: is not a valid JSON Schema"
        ):
            check_constraint(Constraint("json_schema", schema))


def test_hostile_schemas_are_answered_quickly():
    """A user's pattern runs with a time limit, references that fan out or loop are read once,
    and a path token past what an int holds is no index."""
    import time

    fan = [{"$ref": "#/$defs/a"}] * 8
    cases = [
        # a pattern Python's re backtracks on for ages: it does not match that name
        ({"type": "object", "properties": {"a" * 40 + "!": INT}, "patternProperties": {"^(a+)+$": INT}}, None),
        ({"type": "object", "properties": {"a": INT}, "patternProperties": {"(" * 300 + ")" * 300: INT}}, "also matches"),
        ({"$defs": {"a": {"anyOf": fan}}, "type": "integer", "anyOf": [{"$ref": "#/$defs/a"}]}, '"type" beside'),
        ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "type": "integer", "$ref": "#/$defs/a"},
         '"type" beside'),
        ({"type": "integer", "$ref": "#/examples/" + "9" * 5000, "examples": [1]}, '"type" beside'),
        ({"type": "integer", "$ref": "#/examples/²", "examples": [1]}, '"type" beside'),
    ]  # fmt: skip
    chain = {f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(1000)} | {"a1000": INT}
    cases.append(({"$defs": chain, "type": "integer", "anyOf": [{"$ref": "#/$defs/a0"}]}, "takes more than"))
    # every pair of 30 names and 30 patterns that backtrack on them: the whole check has one deadline
    names = {"a" * 15 + "!" + str(i): INT for i in range(30)}
    patterns = {f"^(a|a)*$|^z{{{i}}}$": INT for i in range(30)}
    cases.append(({"type": "object", "properties": names, "patternProperties": patterns}, "takes more than"))
    for schema, named in cases:
        started = time.monotonic()
        try:
            problem = skipped_part(schema)
        except CheckTooCostly as e:
            problem = str(e)
        assert time.monotonic() - started < CHECK_TIME_S + 2.0, schema
        assert problem is None if named is None else named in problem, (schema, problem)


def test_a_check_that_ran_out_of_time_is_not_remembered(monkeypatch):
    """The deadline depends on the machine's load: the same schema is checked again next time
    (definite answers are remembered)."""
    calls = []

    def once_too_costly(schema):
        calls.append(schema)
        if len(calls) == 1:
            raise CheckTooCostly()
        return None

    monkeypatch.setattr(structured_output, "skipped_part", once_too_costly)
    structured_output._skipped_part.cache_clear()
    text = json.dumps({"type": "integer", "title": "only-here"})
    assert structured_output._schema_refusal(text).startswith("the schema takes more than")
    assert structured_output._schema_refusal(text) is None and structured_output._schema_refusal(text) is None
    assert len(calls) == 2
    structured_output._skipped_part.cache_clear()
