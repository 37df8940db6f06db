"""The Python entry point: an Engine built from an EngineConfig, with generate/stream and async variants."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import AsyncIterator, Iterator, Optional, Sequence

from exl2.config import EngineConfig, SamplingSettings
from exl2.generation.chat import ChatTemplate
from exl2.generation.generator import GenerationResult, Generator
from exl2.generation.tokenizer import Tokenizer
from exl2.runtime.loader import load_model


class Engine:
    """A loaded model with its tokenizer and chat template."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.model = load_model(config.model_dir, config.device)
        self.tokenizer = Tokenizer.from_dir(config.model_dir)
        self.template = ChatTemplate.from_tokenizer(self.tokenizer)
        self.generator = Generator(self.model, self.tokenizer, min(config.max_seq_len, self.model.spec.max_position),
                                   config.kv_cache_mode)

    @property
    def model_name(self) -> str:
        return Path(self.config.model_dir).name

    def generate(self, prompt: str, settings: Optional[SamplingSettings] = None, max_new_tokens: int = 256,
                 stop_strings: Sequence[str] = ()) -> GenerationResult:
        return self.generator.generate(prompt, settings, max_new_tokens, stop_strings)

    def stream(self, prompt: str, settings: Optional[SamplingSettings] = None, max_new_tokens: int = 256,
               stop_strings: Sequence[str] = ()) -> Iterator[str]:
        for text, _ in self.generator.stream(prompt, settings, max_new_tokens, stop_strings):
            if text:
                yield text

    def chat_prompt(self, messages: list[dict], tools: Optional[list[dict]] = None) -> str:
        return self.template.render(messages, tools=tools, add_generation_prompt=True)

    def chat(self, messages: list[dict], settings: Optional[SamplingSettings] = None, max_new_tokens: int = 512
             ) -> GenerationResult:
        return self.generator.generate(self.chat_prompt(messages), settings, max_new_tokens, add_bos=False)

    async def agenerate(self, prompt: str, settings: Optional[SamplingSettings] = None, max_new_tokens: int = 256,
                        stop_strings: Sequence[str] = ()) -> GenerationResult:
        return await asyncio.to_thread(self.generate, prompt, settings, max_new_tokens, stop_strings)

    async def astream(self, prompt: str, settings: Optional[SamplingSettings] = None, max_new_tokens: int = 256,
                      stop_strings: Sequence[str] = ()) -> AsyncIterator[str]:
        it = self.stream(prompt, settings, max_new_tokens, stop_strings)
        sentinel = object()
        while True:
            chunk = await asyncio.to_thread(next, it, sentinel)
            if chunk is sentinel:
                return
            yield chunk

    async def aevents(self, prompt: str | list[int], settings: Optional[SamplingSettings] = None,
                      max_new_tokens: int = 256, stop_strings: Sequence[str] = (), add_bos: Optional[bool] = None
                      ) -> AsyncIterator[tuple[str, Optional[GenerationResult]]]:
        """Yield (new text, None) as tokens arrive, then ("", result) with the token ids, finish reason and prompt
        length. Chat prompts from `chat_prompt` pass add_bos=False (the template writes its own BOS)."""
        it = self.generator.stream(prompt, settings, max_new_tokens, stop_strings, add_bos)
        sentinel = object()
        while True:
            event = await asyncio.to_thread(next, it, sentinel)
            if event is sentinel:
                return
            yield event
