"""OpenAI's Responses API (exl2.server.responses) through the official openai client: a real tiny model's greedy
reply equals the engine's chat reply for the same messages (streamed and not), a stored response's conversation
continues through previous_response_id, function calls come back as function_call items (and their outputs go
back in as tool messages), the streamed events arrive in the order clients follow, and unsupported inputs are
400s in OpenAI's error shape."""
import asyncio
import json

import openai
import pytest

from exl2.config import SamplingSettings, ServerConfig
from exl2.server.app import create_app
from exl2.server.responses import input_messages
from test_server import CALL, TOOLS, aclient, engine, fake, fake_app  # noqa: F401 (the fixtures are test_server's)

GREEDY = SamplingSettings(temperature=0)
FLAT_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def app(engine):
    return create_app(engine, ServerConfig(model_name="tiny", max_tokens=16))


def test_greedy_reply_and_conversation_state(app, engine):
    """Not streamed and streamed: the engine's greedy chat reply; the second turn, sent with only the new message
    and previous_response_id, is the engine's reply to the whole conversation; GET and DELETE a stored response."""
    async def go():
        client = aclient(app)
        first = await client.responses.create(model="tiny", input="Hi there", instructions="Be brief.",
                                              temperature=0, max_output_tokens=8)
        second = await client.responses.create(model="tiny", input="And then?", previous_response_id=first.id,
                                               temperature=0, max_output_tokens=8)
        events = [e async for e in await client.responses.create(model="tiny", input="Hi there",
                                                                  instructions="Be brief.", temperature=0,
                                                                  max_output_tokens=8, stream=True)]
        got = await client.responses.retrieve(first.id)
        await client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first.id)
        return first, second, events, got

    first, second, events, got = run(go())
    want = engine.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
                       GREEDY, 8)
    assert first.object == "response" and first.id.startswith("resp_") and first.output_text == want.text
    assert first.output[0].type == "message" and first.output[0].content[0].text == want.text
    assert first.status == ("incomplete" if want.finish_reason == "length" else "completed")
    assert first.usage.input_tokens == want.prompt_tokens and first.usage.output_tokens == len(want.token_ids)
    assert got.id == first.id and got.output_text == first.output_text
    # the instructions were the first request's own: the second turn sees the conversation without them
    again = engine.chat([{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": want.text},
                         {"role": "user", "content": "And then?"}], GREEDY, 8)
    assert second.output_text == again.text and second.previous_response_id == first.id

    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{first.status}"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want.text
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    assert events[-1].response.output_text == want.text and events[-1].response.usage.output_tokens > 0


def test_function_calls_and_their_outputs(fake_app, fake):
    """A call comes back as a function_call item after the text before it; sending its output back (with the call
    as an input item) renders an assistant message with the call and a tool message."""
    async def go(input="1+2?", stream=False, **kw):
        client = aclient(fake_app)
        out = await client.responses.create(model="fake-model", input=input, tools=FLAT_TOOLS, stream=stream, **kw)
        return [e async for e in out] if stream else out

    fake.reply = "Let me add.\n" + CALL
    r = run(go())
    assert [item.type for item in r.output] == ["message", "function_call"]
    call = r.output[1]
    assert r.output[0].content[0].text == "Let me add." and call.name == "add"
    assert json.loads(call.arguments) == {"a": 1, "b": 2} and call.call_id.startswith("call_")
    assert fake.rendered[-1][1] == [{"type": "function", "function": TOOLS[0]["function"]}]

    events = run(go(stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.done" in kinds
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [d.type for d in done] == ["message", "function_call"] and done[1].name == "add"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Let me add.\n"

    fake.reply = "It is 3."
    r = run(go(input=[{"role": "user", "content": "1+2?"},
                      {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 1, "b": 2}'},
                      {"type": "function_call_output", "call_id": "call_1", "output": "3"}]))
    assert r.output_text == "It is 3."
    messages = fake.rendered[-1][0]
    assert messages[1]["role"] == "assistant" and messages[1]["tool_calls"][0]["function"]["name"] == "add"
    assert messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": "3"}

    run(go(tool_choice={"type": "function", "name": "add"}))
    assert fake.forced[-1] == "add"


def test_input_items_become_chat_messages():
    items = [{"role": "developer", "content": "Rules."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Look:"},
                                                             {"type": "input_image", "image_url": "data:x"}]},
             {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hmm"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Calling."}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "ok"}]}]
    out = input_messages(items)
    assert out[0] == {"role": "developer", "content": "Rules."}
    assert out[1]["content"] == [{"type": "text", "text": "Look:"},
                                 {"type": "image_url", "image_url": {"url": "data:x"}}]
    assert out[2]["reasoning_content"] == "hmm" and [c["id"] for c in out[2]["tool_calls"]] == ["c1", "c2"]
    assert out[3] == {"role": "tool", "tool_call_id": "c1", "content": "ok"} and len(out) == 4


def test_a_tool_output_may_hold_images():
    """A function_call_output with an input_image (a screenshot tool's) keeps it as an image part of the tool
    message, which the vision path reads like a user's image."""
    out = input_messages([{"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
                          {"type": "function_call_output", "call_id": "c1",
                           "output": [{"type": "input_text", "text": "Screen:"},
                                      {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}])
    assert out[1] == {"role": "tool", "tool_call_id": "c1",
                      "content": [{"type": "text", "text": "Screen:"},
                                  {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}


def test_unsupported_requests_are_400(fake_app):
    async def go(**kw):
        return await aclient(fake_app).responses.create(model="fake-model", **kw)

    for kw, param in [(dict(input="x", tools=[{"type": "web_search"}]), "tools[0].type"),
                      (dict(input=[{"type": "item_reference", "id": "x"}]), "input[0].type"),
                      (dict(input=[{"role": "tool", "content": "x"}]), "input[0].role"),
                      (dict(input="x", text={"format": {"type": "yaml"}}), "text.format")]:
        with pytest.raises(openai.BadRequestError) as e:
            run(go(**kw))
        assert e.value.body["param"] == param
    with pytest.raises(openai.NotFoundError):
        run(go(input="x", previous_response_id="resp_missing"))
