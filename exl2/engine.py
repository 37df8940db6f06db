"""The Python entry point: an Engine built from an EngineConfig, with generate/stream and async variants."""
from __future__ import annotations

import gc
import threading
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator, Optional, Sequence, Union

import torch

from exl2.config import EngineConfig, LoraSpec, SamplingSettings
from exl2.errors import ConfigError, Exl2Error
from exl2.generation.budget import ReasoningBudget
from exl2.generation.chat import ChatTemplate, tool_call_format
from exl2.generation.constraints import Grammar, json_grammar, regex_grammar, tool_call_grammar
from exl2.generation.dynamic import DynamicGenerator
from exl2.generation.embeddings import EmbeddingResult, Pooling, batches, check_inputs, embed, input_ids
from exl2.generation.generator import GenerationResult, Generator
from exl2.generation.images import ImageTokens
from exl2.generation.job import Event
from exl2.generation.request_loras import check_choice
from exl2.generation.multimodal import VisionPrompts, has_vision_tower, no_vision, split_images
from exl2.generation.speculative import make_drafter
from exl2.generation.templates import choose_template
from exl2.generation.tokenizer import Tokenizer
from exl2.generation.worker import BatchWorker
from exl2.models.rope import RopeOverride
from exl2.runtime.load_progress import reporting, tagged
from exl2.runtime.loader import context_length, engine_rope, load_model
from exl2.runtime.lora import LoraAdapter

class Engine:
    """A loaded model with its tokenizer and chat template. Calls from any number of threads or async tasks run
    concurrently as one batch (a worker thread drives the dynamic generator)."""

    def __init__(self, config: EngineConfig, progress: Optional[Callable[[str, int, int], None]] = None):
        """`progress(kind, done, total)` hears of each decoder layer (then the head) loaded: kind "model", then
        "draft" for a draft model (TabbyAPI's load events)."""
        self.config = config
        self.model = load_model(config.model_dir, config.device, gpu_split=config.gpu_split,
                                cache_tokens=config.cache_size or config.max_seq_len, cache_mode=config.kv_cache_mode,
                                tensor_parallel=config.tensor_parallel, rope=engine_rope(config),
                                experts_per_token=config.experts_per_token, prefill_fp8=config.prefill_fp8,
                                progress=tagged(progress, "model"))
        self.tokenizer = Tokenizer.from_dir(config.model_dir)
        self.template = choose_template(self.tokenizer, config.prompt_template)
        self._named_templates: dict = {}
        self._request_adapters: dict[str, LoraAdapter] = {}   # per-request LoRA directories read so far
        self._lora_lock = threading.Lock()
        self.pooling = Pooling.from_dir(config.model_dir, config.embedding_pooling)
        asked = config.max_seq_len if "max_seq_len" in config.model_fields_set else None  # None: the default
        max_seq_len = context_length(self.model.spec, asked)  # capped at what RoPE covers, with a warning
        with reporting(tagged(progress, "draft")):
            draft = make_drafter(self.model, config.ngram_draft, config.draft_model_dir, max_seq_len,
                                 config.kv_cache_mode, config.num_draft_tokens,
                                 RopeOverride(config.draft_rope_scale, config.draft_rope_alpha),
                                 cache_tokens=config.cache_size,
                                 max_batch=min(config.max_draft_batch, config.max_batch_size))
        self.dynamic = DynamicGenerator(self.model, self.tokenizer, max_seq_len, config.kv_cache_mode,
                                        cache_tokens=config.cache_size, max_batch=config.max_batch_size,
                                        chunk=config.chunk_size, use_graphs=config.cuda_graphs,
                                        draft=draft, num_draft_tokens=config.num_draft_tokens,
                                        flash_attention=config.flash_attention_enabled,
                                        adaptive_draft=config.adaptive_draft,
                                        max_draft_batch=config.max_draft_batch,
                                        host_cache_bytes=int(config.host_cache_gb * 2**30))
        if config.loras:
            self.dynamic.set_loras([self.load_lora(spec) for spec in config.loras])
        self.worker = BatchWorker(self.dynamic)
        self.generator = Generator(self.model, self.tokenizer, max_seq_len, config.kv_cache_mode, self.worker)
        self.vision: Optional[VisionPrompts] = None
        if config.vision:
            self.vision = VisionPrompts.load(config.model_dir, self.model, config.pan_and_scan)

    @property
    def model_name(self) -> str:
        return Path(self.config.model_dir).name

    # what close() releases; reading one afterwards raises a clear error (see __getattr__)
    _RELEASED = ("model", "dynamic", "worker", "generator")

    def close(self) -> None:
        """Release the model: let requests in flight end, stop the generator thread, drop the weights, the KV cache
        and any draft model, and hand freed CUDA memory back to the driver. The engine cannot generate afterwards
        (the tokenizer and chat template stay usable). Calling it again does nothing."""
        if "worker" not in self.__dict__:
            return
        self.worker.close()
        for name in self._RELEASED:
            self.__dict__.pop(name, None)
        gc.collect()                            # the model graph has reference cycles
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    @property
    def loras(self) -> list[LoraAdapter]:
        """The LoRA adapters active on the model."""
        return list(self.dynamic.loras.globals)

    def load_lora(self, spec: LoraSpec) -> LoraAdapter:
        """Read an adapter for this model without applying it (see `set_loras`)."""
        return LoraAdapter.from_dir(spec.path, self.model, spec.scaling)

    def set_loras(self, loras: Sequence[Union[LoraSpec, LoraAdapter]]) -> None:
        """Make exactly these adapters active ([]: none), each read first unless already loaded (`load_lora`).
        LoRAs apply to every request, so the change is refused (ConfigError) while requests run or wait; the
        prompt cache is forgotten and CUDA graphs are captured again (DynamicGenerator.set_loras)."""
        adapters = [x if isinstance(x, LoraAdapter) else self.load_lora(x) for x in loras]
        self.worker.call(lambda: self.dynamic.set_loras(adapters))

    def request_loras(self, loras: Optional[Sequence[Union[LoraSpec, LoraAdapter]]]) -> Optional[tuple]:
        """A request's own adapters as a job takes them: ((adapter, scaling), ...), or None (the engine's active
        ones). A LoraSpec's directory is read once (at scaling 1; its `scaling` then applies per request) and kept
        for later requests; a LoraAdapter is used as it was loaded, an (adapter, scaling) pair as it is."""
        if loras is None:
            return None
        out = []
        for x in loras:
            if isinstance(x, LoraAdapter):
                out.append((x, 1.0))
                continue
            if isinstance(x, tuple):
                out.append(x)
                continue
            key = str(Path(x.path).resolve())
            with self._lora_lock:
                adapter = self._request_adapters.get(key)
                if adapter is None:
                    adapter = self._request_adapters[key] = self.load_lora(LoraSpec(path=x.path))
            out.append((adapter, x.scaling))
        check_choice(tuple(out))
        return tuple(out)

    def set_template(self, choice: Optional[str] = None, template_dir: Optional[Path] = None) -> ChatTemplate:
        """Render chats from now on with the template `choice` names (`generation.templates.choose_template`;
        None: the model's own). Prompts already rendered are not affected."""
        self.template = choose_template(self.tokenizer, choice, template_dir)
        return self.template

    def __getattr__(self, name: str):
        # only reached for attributes the instance lacks: those close() released, or a genuine typo
        if name in Engine._RELEASED:
            raise Exl2Error(f"The engine for {self.model_name} was closed; create a new Engine to generate again.")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def generate(self, prompt: str, settings: Optional[SamplingSettings] = None, max_new_tokens: int = 256,
                 stop_strings: Sequence[str] = (), grammar: Optional[Grammar] = None,
                 logprobs: Optional[int] = None, *, stop_token_ids: Sequence[int] = (), min_new_tokens: int = 0,
                 ignore_eos: bool = False, negative_prompt: Optional[str] = None,
                 loras: Optional[Sequence[Union[LoraSpec, LoraAdapter]]] = None) -> GenerationResult:
        """`grammar` (`json_grammar`, `regex_grammar`) restricts the reply to a format; `logprobs` (k) puts each
        token's log-probability and its k likeliest alternatives in `result.logprobs`. `stop_token_ids` end the
        reply like EOS (not part of its text); before `min_new_tokens` tokens neither they, EOS nor a stop string
        end it (they are not sampled); `ignore_eos` never samples EOS, so the reply runs to `max_new_tokens` or a
        stop. With `settings.cfg_scale` ≠ 1 (classifier-free guidance) the reply steers away from
        `negative_prompt` (None: the BOS token alone). `loras`: this request's own adapters instead of the
        engine's (`request_loras`; [] for the base model), batched with requests that use others."""
        return self.generator.generate(prompt, settings, max_new_tokens, stop_strings, grammar=grammar,
                                       logprobs=logprobs, stop_token_ids=stop_token_ids,
                                       min_new_tokens=min_new_tokens, ignore_eos=ignore_eos,
                                       negative_prompt=negative_prompt, loras=self.request_loras(loras))

    def stream(self, prompt: str, settings: Optional[SamplingSettings] = None, max_new_tokens: int = 256,
               stop_strings: Sequence[str] = (), grammar: Optional[Grammar] = None, *,
               stop_token_ids: Sequence[int] = (), min_new_tokens: int = 0, ignore_eos: bool = False,
               negative_prompt: Optional[str] = None) -> Iterator[str]:
        for text, _ in self.generator.stream(prompt, settings, max_new_tokens, stop_strings, grammar=grammar,
                                             stop_token_ids=stop_token_ids, min_new_tokens=min_new_tokens,
                                             ignore_eos=ignore_eos, negative_prompt=negative_prompt):
            if text:
                yield text

    def embed(self, inputs: Sequence[str | Sequence[int]], dimensions: Optional[int] = None) -> EmbeddingResult:
        """Embedding vectors of texts (tokenized as the model's tokenizer post-processes a document) or token id
        lists: the final hidden states pooled as `self.pooling` says (`generation.embeddings`), the first
        `dimensions` components where given. Runs between the generator's steps, so requests may be generating."""
        ids = input_ids(self.tokenizer, inputs)
        check_inputs(ids, self.model.spec.hidden_size, dimensions, self.dynamic.max_seq_len)
        if not ids:
            return EmbeddingResult(torch.empty(0, dimensions or self.model.spec.hidden_size), [])
        parts = []
        for group in batches([len(x) for x in ids]):   # one forward per call: decode steps run in between
            rows = [ids[i] for i in group]
            parts.append((group, self.worker.call(lambda rows=rows: embed(self.model, rows, self.pooling, dimensions))))
        vectors = torch.empty(len(ids), parts[0][1].shape[1])
        for group, part in parts:
            vectors[group] = part
        return EmbeddingResult(vectors, [len(x) for x in ids])

    def named_template(self, name: str, template_dir: Optional[Path] = None) -> ChatTemplate:
        """The template `name` picks (`choose_template`), compiled once per name and directory; the served one
        is unchanged (a request's own template)."""
        key = (name, template_dir)
        if key not in self._named_templates:
            self._named_templates[key] = choose_template(self.tokenizer, name, template_dir)
        return self._named_templates[key]

    def chat_prompt(self, messages: list[dict], tools: Optional[list[dict]] = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    template: Optional[ChatTemplate] = None, **variables: Any) -> str:
        """The chat template's rendering of `messages` (and `tools`), by default ending where the reply starts,
        with `continue_final_message` inside the last message (`ChatTemplate.render`); `template` instead of the
        served one; `variables` are extra template inputs (e.g. Qwen3's `enable_thinking`)."""
        return (template or self.template).render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=continue_final_message, **variables)

    def chat_input(self, messages: list[dict], tools: Optional[list[dict]] = None,
                   add_generation_prompt: bool = True, continue_final_message: bool = False,
                   template: Optional[ChatTemplate] = None, suffix: str = "", **variables: Any
                   ) -> tuple[Union[str, list[int]], tuple[ImageTokens, ...]]:
        """`chat_prompt` (then `suffix`, e.g. the start of the reply) for messages that may hold images (content
        parts {"type": "image", "image": bytes | path | data URI | URL | PIL image} or OpenAI's image_url parts) or
        videos ({"type": "video", "video": bytes | path | data URI | URL | [frames]} or vLLM's video_url parts; Qwen
        vision models): the text and no images when they hold none, else the token ids with each one's tokens in
        place and the images and videos (for `aevent_stream`'s `images`). Encoding waits for the GPU: call it off
        the event loop."""
        plain, sources = split_images(messages)
        text = self.chat_prompt(plain, tools, add_generation_prompt, continue_final_message, template,
                                **variables) + suffix
        return self.image_prompt(text, sources) if sources else (text, ())

    def image_prompt(self, text: str, sources: Sequence[Any]) -> tuple[list[int], tuple[ImageTokens, ...]]:
        """A rendered chat prompt whose template put one image (or video) token where each of `sources` goes
        (videos as VideoSource), as token ids with each one's tokens in place, and the images and videos (encoded
        once per distinct content)."""
        if self.vision is None:
            raise no_vision(self.model_name, False if has_vision_tower(self.config.model_dir) else None)
        return self.vision.prompt(text, self.tokenizer, sources)

    def chat(self, messages: list[dict], settings: Optional[SamplingSettings] = None, max_new_tokens: int = 512,
             grammar: Optional[Grammar] = None) -> GenerationResult:
        """One reply to `messages`, which may hold images (`chat_input`)."""
        prompt, images = self.chat_input(messages)
        job = self.generator.job(prompt, settings, max_new_tokens, add_bos=False, grammar=grammar)
        job.images = images
        return self.worker.run_all([job])[0]

    def json_grammar(self, schema: Optional[dict] = None) -> Grammar:
        """Replies that are JSON matching `schema` (None: any JSON object); one grammar per request."""
        return json_grammar(self.tokenizer, schema)

    def regex_grammar(self, pattern: str) -> Grammar:
        return regex_grammar(self.tokenizer, pattern)

    def tool_grammar(self, tools: list[dict], name: Optional[str] = None) -> Grammar:
        """Replies that call `tools` (OpenAI-shaped; only the one called `name`, if given) in this model's own
        tool-call format, arguments following each tool's schema; one grammar per request."""
        return tool_call_grammar(self.tokenizer, tools, tool_call_format(self.template), name)

    def generate_batch(self, prompts: Sequence[str], settings: Optional[SamplingSettings] = None,
                       max_new_tokens: int = 256, stop_strings: Sequence[str] = (), *,
                       stop_token_ids: Sequence[int] = (), min_new_tokens: int = 0,
                       ignore_eos: bool = False, negative_prompt: Optional[str] = None,
                       loras: Optional[Sequence[Optional[Sequence[Union[LoraSpec, LoraAdapter]]]]] = None
                       ) -> list[GenerationResult]:
        """Several prompts decoded together; results in prompt order. `loras`: one entry per prompt, each
        `generate`'s (None: the engine's adapters)."""
        choices = [None] * len(prompts) if loras is None else list(loras)
        if len(choices) != len(prompts):
            raise ConfigError(f"generate_batch got {len(prompts)} prompts but {len(choices)} LoRA choices.")
        return self.worker.run_all([self.generator.job(p, settings, max_new_tokens, stop_strings,
                                                       stop_token_ids=stop_token_ids, min_new_tokens=min_new_tokens,
                                                       ignore_eos=ignore_eos, negative_prompt=negative_prompt,
                                                       loras=self.request_loras(c))
                                    for p, c in zip(prompts, choices)])

    async def agenerate(self, prompt: str, settings: Optional[SamplingSettings] = None, max_new_tokens: int = 256,
                        stop_strings: Sequence[str] = (), grammar: Optional[Grammar] = None, *,
                        stop_token_ids: Sequence[int] = (), min_new_tokens: int = 0,
                        ignore_eos: bool = False, negative_prompt: Optional[str] = None) -> GenerationResult:
        result = None
        async for _, r in self.aevents(prompt, settings, max_new_tokens, stop_strings, grammar=grammar,
                                       stop_token_ids=stop_token_ids, min_new_tokens=min_new_tokens,
                                       ignore_eos=ignore_eos, negative_prompt=negative_prompt):
            result = r or result
        return result

    async def astream(self, prompt: str, settings: Optional[SamplingSettings] = None, max_new_tokens: int = 256,
                      stop_strings: Sequence[str] = (), *, stop_token_ids: Sequence[int] = (),
                      min_new_tokens: int = 0, ignore_eos: bool = False,
                      negative_prompt: Optional[str] = None) -> AsyncIterator[str]:
        async for text, _ in self.aevents(prompt, settings, max_new_tokens, stop_strings,
                                          stop_token_ids=stop_token_ids, min_new_tokens=min_new_tokens,
                                          ignore_eos=ignore_eos, negative_prompt=negative_prompt):
            if text:
                yield text

    async def aevents(self, prompt: str | list[int], settings: Optional[SamplingSettings] = None,
                      max_new_tokens: int = 256, stop_strings: Sequence[str] = (), add_bos: Optional[bool] = None,
                      grammar: Optional[Grammar] = None, logprobs: Optional[int] = None, *,
                      stop_token_ids: Sequence[int] = (), min_new_tokens: int = 0, ignore_eos: bool = False,
                      negative_prompt: str | list[int] | None = None, images: Sequence[ImageTokens] = ()
                      ) -> AsyncIterator[tuple[str, Optional[GenerationResult]]]:
        """Yield (new text, None) as tokens arrive, then ("", result) with the token ids, finish reason and prompt
        length. Chat prompts from `chat_prompt` pass add_bos=False (the template writes its own BOS). Closing the
        iterator early cancels the request. The end controls are `generate`'s; `images`: `aevent_stream`'s."""
        events = self.aevent_stream(prompt, settings, max_new_tokens, stop_strings, add_bos, grammar, logprobs,
                                    stop_token_ids=stop_token_ids, min_new_tokens=min_new_tokens,
                                    ignore_eos=ignore_eos, negative_prompt=negative_prompt, images=images)
        try:
            async for event in events:
                if event.text:
                    yield event.text, None
                if event.result is not None:
                    yield "", event.result
        finally:
            await events.aclose()

    async def aevent_stream(self, prompt: str | list[int], settings: Optional[SamplingSettings] = None,
                            max_new_tokens: int = 256, stop_strings: Sequence[str] = (),
                            add_bos: Optional[bool] = None, grammar: Optional[Grammar] = None,
                            logprobs: Optional[int] = None, *, stop_token_ids: Sequence[int] = (),
                            min_new_tokens: int = 0, ignore_eos: bool = False,
                            negative_prompt: str | list[int] | None = None,
                            budget: Optional[ReasoningBudget] = None,
                            images: Sequence[ImageTokens] = (),
                            loras: Optional[Sequence[Union[LoraSpec, LoraAdapter]]] = None) -> AsyncIterator[Event]:
        """`aevents` as the generator's Event objects (text, the new tokens' log-probabilities, the result);
        `budget` (`generation.budget`) closes a think block after so many tokens; `images`: those whose tokens
        the prompt's ids hold (`chat_input`); `loras`: `generate`'s."""
        job = self.generator.job(prompt, settings, max_new_tokens, stop_strings, add_bos, stop_token_ids, grammar,
                                 logprobs, min_new_tokens, ignore_eos, negative_prompt, budget,
                                 self.request_loras(loras))
        job.images = tuple(images)
        events = self.worker.astream(job)
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()
