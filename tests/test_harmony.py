"""The harmony format (gpt-oss; exl2.generation.harmony): a reply's analysis channel is its reasoning, final and
commentary preambles its content, commentary addressed to a function its tool calls; streamed text split at every
position gives the whole reply's split; the server returns the channels apart (not streamed and streamed).
(Forcing a call in this format is refused: test_constraints.)"""
import asyncio
import json

import pytest

from exl2.config import ServerConfig
from exl2.generation.chat import ChatTemplate, parse_tool_calls, tool_call_format
from exl2.generation.harmony import HarmonySplitter, split
from exl2.server.app import create_app
from test_server import TOOLS, FakeEngine, aclient

ANSWER = ("<|channel|>analysis<|message|>The user asks 1+2. Easy.<|end|><|start|>assistant<|channel|>final"
          "<|message|>It is 3.")
CALL = ("<|channel|>analysis<|message|>Use the tool.<|end|><|start|>assistant<|channel|>commentary "
        "to=functions.add <|constrain|>json<|message|>{\"a\": 1, \"b\": 2}<|call|>")
PREAMBLE_CALL = ("<|channel|>commentary<|message|>Adding now.<|end|><|start|>assistant to=functions.add"
                 "<|channel|>commentary json<|message|>{\"a\": 1, \"b\": 2}")
TEMPLATE = "{{ '<|start|>assistant<|channel|>final<|message|>' }}{{ messages[-1]['content'] }}"


@pytest.mark.parametrize("text, want", [
    (ANSWER, ("The user asks 1+2. Easy.", "It is 3.", [])),
    (CALL, ("Use the tool.", "", [{"name": "add", "arguments": {"a": 1, "b": 2}}])),
    (PREAMBLE_CALL, ("", "Adding now.", [{"name": "add", "arguments": {"a": 1, "b": 2}}])),
    ("<|channel|>analysis<|message|>Cut off mid-thought", ("Cut off mid-thought", "", [])),
    ("No channels at all <b>.", ("", "No channels at all <b>.", [])),
])
def test_channels_split_alike_whole_and_streamed(text, want):
    assert split(text) == want
    for cut in [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]:
        splitter, reasoning, content = HarmonySplitter(), "", ""
        for piece in cut:
            r, c = splitter.push(piece)
            reasoning, content = reasoning + r, content + c
        r, c = splitter.finish()
        assert (reasoning + r, content + c, splitter.calls) == want, cut


def test_calls_and_format():
    assert parse_tool_calls(CALL) == [{"name": "add", "arguments": {"a": 1, "b": 2}}]
    assert parse_tool_calls(ANSWER) == []
    assert tool_call_format(ChatTemplate(TEMPLATE)) == "harmony"


@pytest.fixture(scope="module")
def harmony_app():
    fake = FakeEngine()
    fake.template = ChatTemplate(TEMPLATE)
    return fake, create_app(fake, ServerConfig())


def test_the_server_returns_the_channels_apart(harmony_app):
    fake, app = harmony_app

    async def go(reply, stream=False, **kw):
        fake.reply = reply
        out = await aclient(app).chat.completions.create(
            model="gpt-oss", messages=[{"role": "user", "content": "1+2?"}], stream=stream, **kw)
        return [c async for c in out] if stream else out

    r = asyncio.run(go(ANSWER))
    msg = r.choices[0].message
    assert msg.content == "It is 3." and msg.model_extra["reasoning_content"] == "The user asks 1+2. Easy."
    r = asyncio.run(go(CALL, tools=TOOLS))
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.tool_calls[0].function.name == "add"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"a": 1, "b": 2} and not msg.content

    chunks = asyncio.run(go(CALL, stream=True, tools=TOOLS))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "Use the tool."
    assert "".join(d.content or "" for d in deltas) == ""
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert [tc.function.name for tc in calls] == ["add"] and chunks[-1].choices[0].finish_reason == "tool_calls"
    chunks = asyncio.run(go(ANSWER, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "It is 3."
