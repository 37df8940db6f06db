"""The agent loop: the local model answers through its chat template and calls the tools of MCP servers.

Each turn lists the client's tools, renders the conversation with them, generates, and parses tool calls from the
reply. Calls go to the servers through the fastmcp Client; their results (or errors, so the model can react) go
back into the conversation as tool messages, until the model answers without calling anything or max_turns is hit.
"""
from __future__ import annotations

import contextlib
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import mcp.types
from fastmcp import Client
from fastmcp.exceptions import ToolError
from mcp.shared.exceptions import McpError

from exl2.config import SamplingSettings
from exl2.generation.chat import CALL_MARKERS, parse_tool_calls

@dataclass
class ToolCall:
    name: str
    arguments: dict
    result: str
    is_error: bool = False


@dataclass
class AgentResult:
    text: str                                   # the final answer (tool-call markup removed)
    finish_reason: str                          # "stop" (answered), "length" (answer cut at max_tokens), "max_turns"
    messages: list[dict] = field(default_factory=list)   # the whole conversation, HF chat format
    tool_calls: list[ToolCall] = field(default_factory=list)
    turns: int = 0


def openai_tool(tool: mcp.types.Tool) -> dict:
    """An MCP tool as the OpenAI-style function description chat templates expect."""
    params = tool.inputSchema or {"type": "object", "properties": {}}
    return {"type": "function",
            "function": {"name": tool.name, "description": tool.description or "", "parameters": params}}


def result_text(result) -> str:
    """The text a model reads for a tool result: text blocks joined, other content named, else structured JSON."""
    parts = []
    for block in result.content or []:
        if isinstance(block, mcp.types.TextContent):
            parts.append(block.text)
        elif isinstance(block, mcp.types.EmbeddedResource) and hasattr(block.resource, "text"):
            parts.append(block.resource.text)
        else:
            parts.append(f"[{block.type} content: {getattr(block, 'mimeType', None) or 'not shown'}]")
    if not parts and result.structured_content is not None:
        return json.dumps(result.structured_content, ensure_ascii=False)
    return "\n".join(parts)


def reply_content(text: str) -> str:
    """A reply's prose without its tool-call markup (templates that know tool_calls render the calls themselves)."""
    cut = min((i for i in (text.find(m) for m in CALL_MARKERS) if i >= 0), default=-1)
    if cut >= 0:
        return text[:cut].strip()
    return "" if parse_tool_calls(text) else text.strip()


def _renders_tool_calls(engine) -> bool:
    """Whether the chat template writes assistant tool_calls itself; if not (e.g. the ChatML fallback), the
    assistant message keeps its raw text so the conversation still shows the calls."""
    template = getattr(engine, "template", None)
    return template is not None and "tool_calls" in getattr(template, "source", "")


async def call_tool(client: Client, name: str, arguments: dict) -> ToolCall:
    """Call one tool; failures (tool errors, unknown tools, bad arguments) become an error result, not an exception."""
    try:
        result = await client.call_tool(name, arguments, raise_on_error=False)
    except (McpError, ToolError) as e:
        return ToolCall(name, arguments, f"Error: {e}", True)
    text = result_text(result)
    return ToolCall(name, arguments, f"Error: {text}" if result.is_error else text, result.is_error)


async def _generate(engine, prompt: str, settings: SamplingSettings, max_tokens: int):
    events = engine.aevents(prompt, settings, max_new_tokens=max_tokens, add_bos=False)
    result = None
    async with contextlib.aclosing(events):
        async for _, r in events:
            result = r or result
    return result


async def run_agent(engine, client: Client, request: str | list[dict], settings: Optional[SamplingSettings] = None,
                    max_turns: int = 8, max_tokens: int = 1024, system: Optional[str] = None,
                    on_tool_call: Optional[Callable[[ToolCall], Any]] = None) -> AgentResult:
    """Answer `request` (a user prompt or a list of chat messages), letting the model call the client's tools.

    A turn is one model reply; a reply on the last turn that still calls tools ends the run with finish_reason
    "max_turns" (its calls are not made). `on_tool_call` sees each call as it completes (the CLI prints them).
    """
    if max_turns < 1:
        raise ValueError("max_turns must be at least 1")
    settings = settings or SamplingSettings()
    messages = [{"role": "user", "content": request}] if isinstance(request, str) else [dict(m) for m in request]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    calls: list[ToolCall] = []
    keep_markup = not _renders_tool_calls(engine)
    turn = 0
    async with client:
        while True:
            turn += 1
            tools = [openai_tool(t) for t in await client.list_tools()]
            prompt = engine.chat_prompt(messages, tools=tools or None)
            result = await _generate(engine, prompt, settings, max_tokens)
            wanted = parse_tool_calls(result.text)
            if not wanted:
                messages.append({"role": "assistant", "content": result.text})
                return AgentResult(result.text.strip(), result.finish_reason, messages, calls, turn)
            if turn == max_turns:
                return AgentResult(reply_content(result.text), "max_turns", messages, calls, turn)
            ids = [uuid.uuid4().hex[:9] for _ in wanted]  # 9 characters: Mistral's templates insist on it
            messages.append({
                "role": "assistant",
                "content": result.text if keep_markup else reply_content(result.text),
                "tool_calls": [{"id": i, "type": "function",
                                "function": {"name": c["name"], "arguments": c["arguments"]}}
                               for i, c in zip(ids, wanted)],
            })
            for call_id, c in zip(ids, wanted):
                done = await call_tool(client, c["name"], c["arguments"])
                calls.append(done)
                if on_tool_call is not None:
                    on_tool_call(done)
                messages.append({"role": "tool", "tool_call_id": call_id, "name": done.name, "content": done.result})
