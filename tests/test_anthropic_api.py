"""Anthropic's Messages API (exl2.server.anthropic_api) through the official anthropic client: a real tiny model's
greedy reply equals the engine's chat reply for the same messages (streamed and not, the client's own stream
accumulation included), token counting equals the template's, tool_use blocks come back with stop_reason
"tool_use" and go back in as tool calls with their tool_result, stop sequences report themselves, and bad
requests are errors in Anthropic's shape."""
import asyncio
import json

import anthropic
import httpx
import pytest

from exl2.config import SamplingSettings, ServerConfig
from exl2.server.anthropic_api import chat_messages
from exl2.server.errors import APIError
from exl2.server.app import create_app
from test_server import CALL, TOOLS, FakeEngine

GREEDY = SamplingSettings(temperature=0)
KEY = "sk-test"
ADD = {"name": "add", "description": TOOLS[0]["function"]["description"],
       "input_schema": TOOLS[0]["function"]["parameters"]}


def client(app) -> anthropic.AsyncAnthropic:
    import httpx2     # the anthropic client's HTTP library

    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://test")
    return anthropic.AsyncAnthropic(base_url="http://test", api_key=KEY, http_client=http, max_retries=0)


@pytest.fixture(scope="module")
def engine():
    from test_cli import SRC

    from exl2.config import EngineConfig
    from exl2.engine import Engine

    return Engine(EngineConfig(model_dir=SRC, max_seq_len=512, device="cpu"))


@pytest.fixture(scope="module")
def app(engine):
    return create_app(engine, ServerConfig(api_keys=(KEY,), model_name="tiny", max_tokens=16))


@pytest.fixture(scope="module")
def fake():
    return FakeEngine()


@pytest.fixture(scope="module")
def fake_app(fake):
    return create_app(fake, ServerConfig(api_keys=(KEY,)))


def test_greedy_reply_streamed_and_not_and_token_count(app, engine):
    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": [{"type": "text", "text": "How are you?"}]}]

    async def go():
        c = client(app)
        # the current SDK leaves sampling settings out of its signature: they go as extra body fields
        whole = await c.messages.create(model="tiny", max_tokens=8, system="Be brief.", messages=messages,
                                        extra_body={"temperature": 0})
        async with c.messages.stream(model="tiny", max_tokens=8, system="Be brief.", messages=messages,
                                     extra_body={"temperature": 0}) as stream:
            texts = [t async for t in stream.text_stream]
            final = await stream.get_final_message()
        count = await c.messages.count_tokens(model="tiny", system="Be brief.", messages=messages)
        return whole, texts, final, count

    whole, texts, final, count = asyncio.run(go())
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "How are you?"}]
    want = engine.chat(chat, GREEDY, 8)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text == want.text
    assert whole.stop_reason == ("max_tokens" if want.finish_reason == "length" else "end_turn")
    assert whole.usage.output_tokens == len(want.token_ids)
    assert whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0) == want.prompt_tokens
    assert "".join(texts) == want.text and final.content[0].text == want.text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == len(want.token_ids)
    assert count.input_tokens == want.prompt_tokens


def test_stop_sequences_report_themselves(app, engine):
    """A stop sequence taken from the model's own greedy reply ends the reply before it, as stop_sequence."""
    messages = [{"role": "user", "content": "Tell me a story."}]
    want = engine.chat(messages, GREEDY, 16).text
    stop = want.strip().split()[2]
    r = asyncio.run(client(app).messages.create(model="tiny", max_tokens=16, messages=messages,
                                                stop_sequences=[stop], extra_body={"temperature": 0}))
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == want[:want.index(stop)]


def test_structured_output(app):
    """output_config.format holds the reply to its JSON schema (the grammar path of chat completions)."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"],
              "additionalProperties": False}
    r = asyncio.run(client(app).messages.create(
        model="tiny", max_tokens=40, messages=[{"role": "user", "content": "Name a colour."}],
        output_config={"format": {"type": "json_schema", "schema": schema}}))
    assert r.stop_reason == "end_turn" and set(json.loads(r.content[0].text)) == {"name"}


def test_tool_use_round_trip(fake_app, fake):
    async def go(**kw):
        return await client(fake_app).messages.create(model="fake-model", max_tokens=64, tools=[ADD], **kw)

    fake.reply = "Let me add.\n" + CALL
    r = asyncio.run(go(messages=[{"role": "user", "content": "1+2?"}]))
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["text", "tool_use"]
    use = r.content[1]
    assert r.content[0].text == "Let me add." and use.name == "add" and use.input == {"a": 1, "b": 2}
    assert fake.rendered[-1][1] == [{"type": "function", "function": {
        "name": "add", "description": ADD["description"], "parameters": ADD["input_schema"]}}]

    async def streamed():
        async with client(fake_app).messages.stream(model="fake-model", max_tokens=64, tools=[ADD],
                                                    messages=[{"role": "user", "content": "1+2?"}]) as stream:
            return await stream.get_final_message()

    final = asyncio.run(streamed())
    assert [b.type for b in final.content] == ["text", "tool_use"] and final.content[1].input == {"a": 1, "b": 2}
    assert final.stop_reason == "tool_use"

    fake.reply = "It is 3."
    asyncio.run(go(messages=[
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Adding."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "add",
                                           "input": {"a": 1, "b": 2}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "3"}]}],
        tool_choice={"type": "tool", "name": "add"}))
    rendered = fake.rendered[-1][0]
    assert rendered[1]["tool_calls"][0]["function"]["name"] == "add"
    assert dict(rendered[1]["tool_calls"][0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert rendered[2] == {"role": "tool", "tool_call_id": "toolu_1", "content": "3"} and fake.forced[-1] == "add"



def test_blocks_become_chat_messages():
    out = chat_messages([
        {"role": "user", "content": [{"type": "text", "text": "Look"},
                                     {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                  "data": "AAAA"}}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "x"},
                                          {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                      "content": [{"type": "text", "text": "boom"}]},
                                     {"type": "text", "text": "Try again."}]}])
    assert out[0]["content"][1] == {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    assert out[1]["reasoning_content"] == "hmm" and out[1]["tool_calls"][0]["id"] == "t1"
    assert out[2] == {"role": "tool", "tool_call_id": "t1", "content": "Error: boom"}
    assert out[3] == {"role": "user", "content": [{"type": "text", "text": "Try again."}]}


def test_a_tool_result_may_hold_images():
    """A tool_result with an image block (a screenshot tool's) becomes a tool message of text and image parts;
    a failed one says so first; other blocks there are a 400."""
    shot = {"type": "image", "source": {"type": "url", "url": "https://example.com/s.png"}}
    out = chat_messages([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                                       "content": [{"type": "text", "text": "Screen:"}, shot]}]}])
    assert out == [{"role": "tool", "tool_call_id": "t1",
                    "content": [{"type": "text", "text": "Error:"}, {"type": "text", "text": "Screen:"},
                                {"type": "image_url", "image_url": {"url": "https://example.com/s.png"}}]}]
    with pytest.raises(APIError) as e:
        chat_messages([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                     "content": [shot, {"type": "document"}]}]}])
    assert e.value.param == "messages[0].content[0].content[1]"


def test_errors_in_anthropic_shape(fake_app):
    async def post(body, key=KEY):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=fake_app), base_url="http://test") as h:
            return await h.post("/v1/messages", json=body, headers={"x-api-key": key})

    for body, words in [({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
                        ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "role"),
                        ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                          "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "Server tools")]:
        r = asyncio.run(post(body))
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == "invalid_request_error" and words in r.json()["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        asyncio.run(client(fake_app).messages.create(model="m", max_tokens=5, messages=[
            {"role": "user", "content": [{"type": "document", "source": {}}]}]))
