"""``pantheon.chat.partial_json``: a JSON value's ``json.dumps`` spelling as its text grows."""

from __future__ import annotations

import json

import pytest

from pantheon.chat.partial_json import json_so_far

TEXTS = [
    '{"a":1}',
    '{ "a" : [1, 2.50, -0, 1e5, 1E-2, true,false,null, NaN, -Infinity], "b": {"c": {}, "d": []}}',
    '{"s": "x\\ny\\u00e9\\ud83d\\ude00\\/\\"q\\\\", "t": "\\ud800x", "u": "\\ud800\\u0041", "v": "\\u0001"}',
    '{"k": "é😀 plain", "n": 12345678901234567890, "f": 0.1}',
    "[1,[2,[3]],{}]",
]


@pytest.mark.parametrize("text", TEXTS)
def test_a_whole_value_is_json_dumps_and_every_prefix_gives_a_prefix_of_it(text):
    whole, end = json_so_far(text)
    assert whole == json.dumps(json.loads(text), ensure_ascii=False)
    assert end == len(text)
    before = ""
    for k in range(len(text)):
        got, cut_end = json_so_far(text[:k])
        assert cut_end is None
        assert got.startswith(before) and whole.startswith(got)
        before = got


@pytest.mark.parametrize(
    "text,so_far",
    [
        ('{"a": 1e', '{"a": '),  # a number waits until it is whole
        ('{"a": tru', '{"a": '),
        ('{"a": "x\\u00', '{"a": "x'),  # so does an escape
        ('{"a": "\\ud83d', '{"a": "'),  # and a high surrogate, until the next escape says
        ('{"a": 1.}', '{"a": '),  # not JSON: what was certain before
        ('{"a": "x\ny"}', '{"a": "x'),  # a control character (Python's json is strict)
        ('{"a": 1} trailing', '{"a": 1}'),
    ],
)
def test_what_is_not_yet_certain_waits(text, so_far):
    assert json_so_far(text)[0] == so_far
