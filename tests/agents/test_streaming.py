"""``ChoiceStream``: what a streamed reply sends, token by token, over a byte-level decoder
(each token one byte, as the byte tokenizer's): pieces always add up to the final text, never
show a stop string or a tool call, and never split a character."""

from __future__ import annotations

from relax.agents._chat import parse_tool_calls
from relax.agents._streaming import ChoiceStream
from relax.engines import TokenEvent


def decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def play(text: str, stops: list[str], tools: bool = False) -> tuple[list[str], ChoiceStream]:
    stream = ChoiceStream(decode, stops, tools)
    pieces = []
    for k, byte in enumerate(text.encode()):
        sent = stream.add(TokenEvent(0, byte, -float(k), 0))
        if sent is not None:
            pieces.append(sent[0])
    return pieces, stream


def test_multibyte_characters_wait_for_their_last_byte() -> None:
    pieces, stream = play("héllo ✓", [])
    assert "".join(pieces) == "héllo ✓"
    assert all("\ufffd" not in p for p in pieces)
    assert stream.sent_tokens == len("héllo ✓".encode())


def test_a_stop_string_is_held_back_and_never_sent() -> None:
    pieces, stream = play("abc<|x|>def", ["<|x|>"])
    assert "".join(pieces) == "abc"
    # What might have begun a stop string went out once it could not be one any more.
    pieces, _ = play("a<b<|", ["<|x|>"])
    assert "".join(pieces) == "a<b"  # "<|" is still held: it may grow into "<|x|>"
    pieces, _ = play("a<b<|c", ["<|x|>"])
    assert "".join(pieces) == "a<b<|c"  # ...and "<|c" cannot
    rest, first, end = stream.finish("abc", kept=8)
    assert (rest, first, end) == ("", 3, 8)  # the stop's tokens' logprobs go in the last piece


def test_tool_calls_and_surrounding_whitespace_are_held_for_the_end() -> None:
    text = '  Let me check. <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    pieces, stream = play(text, [], tools=True)
    content, calls = parse_tool_calls(text)
    assert [c.name for c in calls] == ["f"] and content == "Let me check."
    assert "".join(pieces) == "Let me check."
    assert stream.finish(content, kept=len(text.encode()))[0] == ""
    # Not a valid call: the text stays the model's, and the rest goes out at the end.
    bad = "Hi <tool_call>not json</tool_call>"
    pieces, stream = play(bad, [], tools=True)
    content, calls = parse_tool_calls(bad)
    assert calls == [] and content == bad
    rest, _, _ = stream.finish(content, kept=len(bad.encode()))
    assert "".join(pieces) + rest == bad
