"""JSON numbers end (issue 39 §4): the grammar of a JSON Schema refuses a digit run past the
bound (16 integral digits, as llama.cpp's json-schema-to-grammar; 10 fraction digits), in named
numbers, in any-values and in tools' arguments, while every bound a schema gives holds.

Checked with an llguidance matcher over the bytes of a candidate output, on the grammar the
router sends to the worker (``structured.json_schema_grammar``)."""

from __future__ import annotations

import llguidance as llg
import pytest

from pantheon.api import structured
from pantheon.core.json_numbers import ANY, FRACTION_DIGITS, INTEGRAL_DIGITS, bound_numbers
from pantheon.errors import ApiError


def matcher(grammar: str) -> llg.LLMatcher:
    return llg.LLMatcher(structured._bytes(), grammar, log_level=0)


def accepts(grammar: str, text: str) -> bool:
    """Whether ``grammar`` matches ``text`` exactly, one byte a token."""
    m = matcher(grammar)
    return m.consume_tokens(structured._bytes().tokenize_str(text)) and m.is_accepting()


def grammar(schema) -> str:
    return structured.json_schema_grammar(schema, "response_format")


def test_a_float_in_a_range_ends_after_its_fraction_bound():
    g = grammar({"type": "number", "minimum": 0, "maximum": 100})
    assert accepts(g, "88.5") and accepts(g, "0") and accepts(g, "100")
    assert accepts(g, "88." + "8" * FRACTION_DIGITS)
    assert not accepts(g, "88." + "8" * (FRACTION_DIGITS + 1))
    assert not accepts(g, "100.5") and not accepts(g, "-1")
    # the run is refused at the digit past the bound, not only at the end: the model must stop
    m = matcher(g)
    assert m.consume_tokens(structured._bytes().tokenize_str("88." + "8" * FRACTION_DIGITS))
    assert not m.consume_tokens(structured._bytes().tokenize_str("8"))


def test_unbounded_integers_and_numbers_take_at_most_sixteen_integral_digits():
    ints = grammar({"type": "integer"})
    assert accepts(ints, str(2**53 - 1)) and accepts(ints, str(-(2**53 - 1)))
    assert not accepts(ints, str(2**53)) and not accepts(ints, "1" + "0" * INTEGRAL_DIGITS)
    nums = grammar({"type": "number", "minimum": 0})
    assert accepts(nums, "9" * INTEGRAL_DIGITS + ".5")
    assert not accepts(nums, "1" + "0" * INTEGRAL_DIGITS)
    assert not accepts(nums, "1." + "1" * (FRACTION_DIGITS + 1))


def test_the_schemas_own_bounds_hold():
    assert not accepts(grammar({"type": "number", "exclusiveMinimum": 0}), "0")
    assert not accepts(grammar({"type": "integer", "maximum": 5}), "6")
    assert accepts(grammar({"type": "number", "multipleOf": 0.5}), "1.5")
    assert not accepts(grammar({"type": "number", "multipleOf": 0.5}), "1.25")
    big = "1" + "0" * 17  # a lower bound past the default upper one stays satisfiable
    assert accepts(grammar({"type": "integer", "minimum": 10**17}), big)
    assert accepts(grammar({"type": "number", "minimum": 1e17}), big)
    assert accepts(grammar({"const": 1.5}), "1.5")


def test_numbers_inside_any_values_end_too():
    long = "1." + "1" * (FRACTION_DIGITS + 1)
    for schema in ({"type": "object"}, {}, True):
        g = grammar(schema)
        inner = '{"a": [1, {"b": X}]}'
        assert accepts(g, inner.replace("X", "2.25")), schema
        assert not accepts(g, inner.replace("X", long)), schema
        assert not accepts(g, inner.replace("X", "1" * (INTEGRAL_DIGITS + 1))), schema
    assert accepts(grammar({}), '"text"') and accepts(grammar({}), "null")
    # json_object: any object, its values' numbers bounded
    kind, g = structured.request_grammar({"response_format": {"type": "json_object"}})
    assert kind == "json_object" and g is not None
    assert accepts(g, '{"x": 1.5, "y": [true, null]}') and not accepts(g, '{"x": ' + long + "}")


def test_typed_unions_refs_and_anyof_are_bounded():
    long = "1." + "1" * (FRACTION_DIGITS + 1)
    for schema in (
        {"type": ["number", "null"]},
        {"anyOf": [{"type": "number"}, {"type": "string"}]},
        {"$defs": {"P": {"type": "number"}}, "$ref": "#/$defs/P"},
    ):
        g = grammar(schema)
        assert accepts(g, "1.5") and not accepts(g, long), schema


def test_a_tools_arguments_are_bounded_where_nested():
    tool = {"type": "function", "function": {"name": "set", "parameters": {
        "type": "object", "properties": {"level": {"type": "number"}}, "required": ["level"]}}}  # fmt: skip
    g = structured.tool_grammar([tool], None, "")
    call = '<tool_call>\n{"name": "set", "arguments": {"level": X}}\n</tool_call>'
    assert accepts(g, call.replace("X", "2.5"))
    assert not accepts(g, call.replace("X", "2." + "5" * (FRACTION_DIGITS + 1)))


def test_the_rewrite_leaves_its_input_alone_and_nested_schemas_have_no_defs():
    schema = {"type": "object", "properties": {"x": {"type": "number"}}}
    before = repr(schema)
    out = bound_numbers(schema)
    assert repr(schema) == before
    assert ANY in out["$defs"] and out["properties"]["x"]["exclusiveMaximum"] == 10.0**INTEGRAL_DIGITS
    nested = bound_numbers(schema, root=False)
    assert "$defs" not in nested and "additionalProperties" not in nested


@pytest.mark.parametrize(
    "schema", [{"type": "number", "minimum": 5, "maximum": 3}, {"type": "integer", "maximum": -(10**17)}]
)
def test_a_bad_numeric_schema_is_still_a_400_and_a_far_bound_is_not(schema):
    if schema.get("minimum") == 5:
        with pytest.raises(ApiError):
            grammar(schema)
    else:  # an upper bound below the default lower one: the added lower bound goes further
        assert accepts(grammar(schema), "-" + "1" + "0" * 17)
