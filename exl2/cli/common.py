"""Flags and helpers shared by the subcommands."""
from __future__ import annotations

import argparse
import math
import os
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional

from exl2.config import CHUNK_DEFAULT, CHUNK_MAX, CHUNK_MIN, LoraSpec, SamplingSettings
from exl2.errors import ConfigError

if TYPE_CHECKING:
    from exl2.models.rope import RopeOverride


KEY_ENV = "EXL2_API_KEY"     # the API keys of `exl2 serve` and `exl2 mcp serve --transport http`, comma-separated


def env_keys(var: str) -> list[str]:
    """The comma-separated keys in environment variable `var` (keeps them out of `ps`)."""
    return [k.strip() for k in os.environ.get(var, "").split(",") if k.strip()]


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model_dir", "--model", dest="model_dir", default=None,
                   help="model directory (HF fp16/bf16, EXL2 or GPTQ); default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="where to run (default: cuda if available)")
    p.add_argument("-l", "--max_seq_len", "--max-seq-len", dest="max_seq_len", type=int, default=None,
                   help="context length to allocate (default 4096, or the model's context if shorter); longer "
                        "than the model's context needs -rs/-ra/-ry, else it is capped with a warning")
    p.add_argument("--chunk-size", "--chunk_size", dest="chunk_size", type=int, default=None,
                   help="prompt tokens prefilled in one forward at most (default 2048; smaller needs less memory)")
    p.add_argument("-ng", "--no-graphs", "--no_graphs", dest="no_graphs", action="store_true",
                   help="run decode steps eagerly instead of from CUDA graphs (slower; for profiling and debugging)")
    p.add_argument("-cm", "--cache-mode", "--cache_mode", dest="cache_mode", default="fp16",
                   choices=["fp16", "q8", "q6", "q4", "q3", "q2"],
                   help="KV cache storage: fp16 or quantized (q8, q6 = 8-bit keys/4-bit values, q4, q3, q2)")
    add_experts_arg(p)
    add_rope_args(p)
    add_gpu_args(p)
    p.add_argument("--prefill-fp8", "--prefill_fp8", dest="prefill_fp8", action="store_true",
                   help="prompt matmuls of EXL2/GPTQ weights in FP8 on GPUs that have it (sm_89+): faster long "
                        "prompts, slightly different numbers; decoding stays exact")


def add_template_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-template", "--prompt_template", dest="prompt_template", default=None,
                   metavar="NAME|FILE", help="chat template instead of the model's own: a .jinja file, a bundled "
                                             "name (chatml, alpaca) or one the model's tokenizer_config.json lists "
                                             "(e.g. tool_use)")


def add_experts_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("-ept", "--experts_per_token", "--experts-per-token", dest="experts_per_token", type=int,
                   default=None, help="experts a mixture-of-experts model routes each token to (default: the "
                                      "model's own; fewer are faster and worse)")


def add_rope_args(p: argparse.ArgumentParser) -> None:
    """exllamav2's RoPE overrides, which let a model run past its native context (default: config.json's)."""
    p.add_argument("-rs", "--rope_scale", "--rope-scale", dest="rope_scale", type=float, default=None,
                   help="linear RoPE scaling: positions divided by this factor; the context may grow to native "
                        "× factor")
    p.add_argument("-ra", "--rope_alpha", "--rope-alpha", dest="rope_alpha", type=float, default=None,
                   help="NTK-aware RoPE alpha: the base times alpha^(d/(d-2)); -l is then taken as given (e.g. "
                        "alpha 2.6 for twice the native context)")
    p.add_argument("-ry", "--rope_yarn", "--rope-yarn", dest="rope_yarn", type=float, default=None,
                   help="YaRN RoPE factor over the native context (or the config's own YaRN original); the "
                        "context may grow to original × factor; not with -rs/-ra")


def rope_from_args(args) -> RopeOverride:
    """The RoPE override of the -rs/-ra/-ry flags (one-sentence ConfigError when invalid); an explicit -l is
    the length -ra allows."""
    from exl2.models.rope import RopeOverride

    return RopeOverride(getattr(args, "rope_scale", None), getattr(args, "rope_alpha", None),
                        getattr(args, "rope_yarn", None), context=getattr(args, "max_seq_len", None))


def draft_rope_from_args(args) -> RopeOverride:
    """The draft model's RoPE override of --draft-rope-scale/--draft-rope-alpha (one-sentence ConfigError when
    invalid)."""
    from exl2.config import rope_factor_problem
    from exl2.models.rope import RopeOverride

    scale, alpha = getattr(args, "draft_rope_scale", None), getattr(args, "draft_rope_alpha", None)
    problem = rope_factor_problem("--draft-rope-scale", scale) or rope_factor_problem("--draft-rope-alpha", alpha)
    if problem:
        raise ConfigError(f"{problem}.")
    return RopeOverride(scale, alpha)


def add_gpu_args(p: argparse.ArgumentParser, also: str = "") -> None:
    """-gs and -tp; `also` ends both helps (what they mean for a command's other models)."""
    p.add_argument("-gs", "--gpu_split", "--gpu-split", dest="gpu_split", default=None, metavar="GB,GB,...|auto",
                   help="split the model's layers over several CUDA GPUs: GB per GPU in order, each filled before "
                        "the next (e.g. 20,24; weights plus the KV cache of their layers), or 'auto' (the free "
                        "memory of every visible GPU less 1 GB each); default: one device. See docs/multi_gpu.md"
                        + also)
    p.add_argument("-tp", "--tensor_parallel", "--tensor-parallel", dest="tensor_parallel", action="store_true",
                   help="shard every layer over several CUDA GPUs instead of splitting the layers: those -gs gives "
                        "a budget above 0, or every visible GPU (needs the KV head count to be a multiple of the "
                        "GPU count; not for MoE or MLA models)" + also)


def add_draft_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-ngram", "--ngram", dest="ngram_draft", action="store_true",
                   help="speculative decoding from n-grams of each request's own text")
    p.add_argument("-dm", "--draft_model_dir", "--draft-model", dest="draft_model_dir", default=None,
                   help="speculative decoding with this small draft model (same tokenizer)")
    p.add_argument("-dn", "--draft_tokens", "--num-draft-tokens", dest="num_draft_tokens", type=int, default=4,
                   help="tokens guessed and checked per step when drafting (default 4)")
    p.add_argument("--max-draft-batch", "--max_draft_batch", dest="max_draft_batch", type=int, default=8,
                   help="draft while at most this many requests decode at once (default 8; larger batches "
                        "decode plainly, and each guesses fewer tokens past 3 requests)")
    p.add_argument("--draft-rope-scale", "--draft_rope_scale", dest="draft_rope_scale", type=float, default=None,
                   help="the draft model's linear RoPE scale (default: its own, or an NTK alpha where its native "
                        "context is shorter than the model's)")
    p.add_argument("--draft-rope-alpha", "--draft_rope_alpha", dest="draft_rope_alpha", type=float, default=None,
                   help="the draft model's NTK RoPE alpha (default: as --draft-rope-scale says)")


def add_lora_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora", dest="loras", action="append", default=None, metavar="DIR",
                   help="apply this PEFT LoRA adapter (adapter_config.json and adapter_model.safetensors) at "
                        "runtime; repeatable, the adapters' updates add up")
    p.add_argument("--lora-scaling", "--lora_scaling", dest="lora_scaling", action="append", type=float,
                   default=None, metavar="S",
                   help="scale of the --lora at the same position (repeatable; default 1.0 for each)")


def lora_specs(args) -> list[LoraSpec]:
    """The --lora adapters with their --lora-scaling, checked before the model loads: a missing directory or a
    bad scale is a one-sentence ConfigError (the adapter files are read with the model)."""
    dirs = getattr(args, "loras", None) or []
    scales = getattr(args, "lora_scaling", None) or []
    if len(scales) > len(dirs):
        raise ConfigError(f"--lora-scaling is given {len(scales)} times but --lora only {len(dirs)}; each scale "
                          "belongs to the --lora at its position.")
    specs = []
    for i, d in enumerate(dirs):
        path = Path(d)
        if not path.is_dir():
            raise ConfigError(f"--lora {d}: {'is not a directory' if path.exists() else 'does not exist'}.")
        scale = scales[i] if i < len(scales) else 1.0
        if not (math.isfinite(scale) and scale >= 0):
            raise ConfigError(f"--lora-scaling must be a number of at least 0, not {scale}.")
        specs.append(LoraSpec(path=path, scaling=scale))
    return specs


def model_settings(args) -> dict:
    """The EngineConfig fields add_model_args' flags set."""
    from exl2.runtime.placement import parse_gpu_split

    settings = dict(model_dir=resolve_model_dir(args.model_dir),
                    kv_cache_mode=args.cache_mode, device=args.device, gpu_split=parse_gpu_split(args.gpu_split),
                    tensor_parallel=args.tensor_parallel, rope_scale=args.rope_scale, rope_alpha=args.rope_alpha,
                    rope_yarn=args.rope_yarn, experts_per_token=args.experts_per_token,
                    prefill_fp8=args.prefill_fp8)
    if args.max_seq_len is not None:  # left out, EngineConfig's default applies and counts as not asked for
        settings["max_seq_len"] = args.max_seq_len
    if getattr(args, "chunk_size", None) is not None:
        settings["chunk_size"] = args.chunk_size
    if getattr(args, "no_graphs", False):
        settings["cuda_graphs"] = False
    return settings


def engine_settings(args) -> dict:
    """The EngineConfig fields the shared model, draft, LoRA and template flags set."""
    settings = model_settings(args)
    settings.update(ngram_draft=args.ngram_draft, draft_model_dir=args.draft_model_dir,
                    num_draft_tokens=args.num_draft_tokens, max_draft_batch=args.max_draft_batch,
                    draft_rope_scale=args.draft_rope_scale,
                    draft_rope_alpha=args.draft_rope_alpha, prompt_template=getattr(args, "prompt_template", None))
    loras = lora_specs(args)
    if loras:
        settings["loras"] = loras
    return settings


def add_sampling_args(p: argparse.ArgumentParser, temperature: float = 0.8) -> None:
    p.add_argument("-temp", "--temperature", type=float, default=temperature,
                   help=f"sampling temperature, 0 = greedy (default {temperature})")
    p.add_argument("-topk", "--top-k", "--top_k", dest="top_k", type=int, default=0, help="top-k cutoff, 0 = off")
    p.add_argument("-topp", "--top-p", "--top_p", dest="top_p", type=float, default=1.0, help="nucleus cutoff (default 1.0)")
    p.add_argument("-minp", "--min-p", "--min_p", dest="min_p", type=float, default=0.0, help="min-p cutoff (default 0)")
    p.add_argument("-repp", "--repetition-penalty", dest="repetition_penalty", type=float, default=1.0,
                   help="repetition penalty (default 1.0 = off)")
    p.add_argument("--repetition-range", "--repetition_range", dest="repetition_range", type=int, default=0,
                   help="the repetition penalty looks at the last N tokens only (default 0 = the whole text)")
    p.add_argument("--repetition-decay", "--repetition_decay", dest="repetition_decay", type=int, default=0,
                   help="... fading linearly to nothing over the N tokens before that range (default 0)")
    p.add_argument("--banned-string", "--banned_string", dest="banned_strings", action="append", default=None,
                   metavar="TEXT", help="text the reply must never contain (case ignored; repeat the flag for more)")
    p.add_argument("--token-healing", "--token_healing", dest="token_healing", action="store_true",
                   help="take the prompt's last token off and let the reply's first token regrow it (a prompt that "
                        "ends mid-word continues as the model would tokenize it)")
    p.add_argument("-freqpen", "--frequency-penalty", "--frequency_penalty", dest="frequency_penalty", type=float,
                   default=0.0, help="subtracted from a token's logit per time the reply has it (default 0)")
    p.add_argument("-prespen", "--presence-penalty", "--presence_penalty", dest="presence_penalty", type=float,
                   default=0.0, help="subtracted once from the logit of every token the reply has (default 0)")
    p.add_argument("--seed", type=int, default=None, help="random seed for reproducible sampling")
    # exllamav2's further samplers (its chat/test flags), each off at its default
    p.add_argument("-topa", "--top-a", "--top_a", dest="top_a", type=float, default=0.0,
                   help="top-a cutoff: drop tokens with p < top_a · p_max² (default 0 = off)")
    p.add_argument("-typical", "--typical", dest="typical", type=float, default=1.0,
                   help="locally typical sampling's probability mass (default 1 = off)")
    p.add_argument("-tfs", "--tfs", dest="tfs", type=float, default=1.0,
                   help="tail-free sampling's z (default 1 = off)")
    p.add_argument("-smooth", "--smoothing-factor", "--smoothing_factor", dest="smoothing_factor", type=float,
                   default=0.0, help="quadratic sampling's smoothing factor (default 0 = off)")
    p.add_argument("-dyntemp", "--dynamic-temperature", "--dynamic_temperature", dest="dynamic_temperature",
                   default=None, metavar="MIN,MAX,EXP",
                   help="dynamic temperature from the entropy, between MIN and MAX with exponent EXP, in place of "
                        "the temperature (e.g. 0.5,1.5,1; default off)")
    p.add_argument("--temperature-last", "--temperature_last", dest="temperature_last", action="store_true",
                   help="apply the temperature after the truncation samplers instead of before")
    p.add_argument("-xtcp", "--xtc-probability", "--xtc_probability", dest="xtc_probability", type=float,
                   default=0.0, help="XTC: chance per token of dropping the most likely choices (default 0 = off)")
    p.add_argument("-xtct", "--xtc-threshold", "--xtc_threshold", dest="xtc_threshold", type=float, default=0.1,
                   help="XTC: probability from which a choice counts as a top choice (default 0.1)")
    p.add_argument("-skew", "--skew", type=float, default=0.0,
                   help="skew the draw toward less likely tokens (> 0) or likelier ones (< 0) (default 0 = off)")
    p.add_argument("-drym", "--dry-multiplier", "--dry_multiplier", dest="dry_multiplier", type=float, default=0.0,
                   help="DRY repetition penalty's multiplier (default 0 = off)")
    p.add_argument("-drya", "--dry-allowed-length", "--dry_allowed_length", dest="dry_allowed_length", type=int,
                   default=2, help="DRY: longest repeat left unpenalized (default 2)")
    p.add_argument("-dryb", "--dry-base", "--dry_base", dest="dry_base", type=float, default=1.75,
                   help="DRY: the penalty's growth per token of repeat (default 1.75)")
    p.add_argument("-dryr", "--dry-range", "--dry_range", dest="dry_range", type=int, default=0,
                   help="DRY: tokens of the text it looks back over (default 0 = all)")
    p.add_argument("--dry-max-ngram", "--dry_max_ngram", dest="dry_max_ngram", type=int, default=20,
                   help="DRY: the longest repeat it measures (default 20)")
    p.add_argument("--dry-sequence-breakers", "--dry_sequence_breakers", dest="dry_sequence_breakers", default=None,
                   metavar="S,S,...", help="DRY: strings that end a repeat, separated by commas (escapes such as "
                                           "\\n are decoded); default: punctuation, newline and special tokens")
    p.add_argument("-mirostat", "--mirostat", dest="mirostat_mode", type=int, default=0, choices=[0, 2],
                   help="2 = Mirostat 2.0 sampling (default 0 = off)")
    p.add_argument("--mirostat-tau", "--mirostat_tau", dest="mirostat_tau", type=float, default=1.5,
                   help="Mirostat's target surprise (default 1.5)")
    p.add_argument("--mirostat-eta", "--mirostat_eta", dest="mirostat_eta", type=float, default=0.1,
                   help="Mirostat's learning rate (default 0.1)")


def flag_error(e) -> ConfigError:
    """A pydantic ValidationError of settings built from flags as one sentence naming the flag."""
    err = e.errors(include_url=False)[0]
    return ConfigError(f"Invalid --{err['loc'][0]}: {err['msg'].removeprefix('Value error, ')}.")


def dynamic_temperature(value: str | None) -> dict[str, float]:
    """-dyntemp's 'min,max,exponent' as SamplingSettings fields (none when not given)."""
    if value is None:
        return {}
    try:
        low, high, exponent = (float(x) for x in value.split(","))
    except ValueError:
        raise ConfigError("--dynamic-temperature takes three numbers min,max,exponent (e.g. 0.5,1.5,1), "
                          f"not {value!r}.") from None
    return dict(min_temp=low, max_temp=high, temp_exponent=exponent)


def sequence_breakers(value: str | None) -> tuple[str, ...] | None:
    """--dry-sequence-breakers' comma-separated strings, backslash escapes decoded (a shell passes '\\n' as two
    characters); None (the engine's set) when not given or empty."""
    if not value:
        return None
    if "\\" in value:
        value = value.encode("latin-1", "backslashreplace").decode("unicode_escape")
    return tuple(b for b in value.split(",") if b) or None


def sampling_from_args(args, **extra) -> SamplingSettings:
    """SamplingSettings from add_sampling_args' flags and `extra` fields a command's own flags set (generate's
    cfg_scale); an invalid value is a one-sentence ConfigError."""
    from pydantic import ValidationError

    try:
        return SamplingSettings(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                                repetition_penalty=args.repetition_penalty, repetition_range=args.repetition_range,
                                repetition_decay=args.repetition_decay,
                                banned_strings=tuple(args.banned_strings) if args.banned_strings else None,
                                token_healing=args.token_healing,
                                frequency_penalty=args.frequency_penalty,
                                presence_penalty=args.presence_penalty, seed=args.seed, top_a=args.top_a,
                                typical=args.typical, tfs=args.tfs, smoothing_factor=args.smoothing_factor,
                                temperature_last=args.temperature_last, xtc_probability=args.xtc_probability,
                                xtc_threshold=args.xtc_threshold, skew=args.skew, dry_multiplier=args.dry_multiplier,
                                dry_allowed_length=args.dry_allowed_length, dry_base=args.dry_base,
                                dry_range=args.dry_range, dry_max_ngram=args.dry_max_ngram,
                                dry_sequence_breakers=sequence_breakers(args.dry_sequence_breakers),
                                mirostat_mode=args.mirostat_mode, mirostat_tau=args.mirostat_tau,
                                mirostat_eta=args.mirostat_eta, **dynamic_temperature(args.dynamic_temperature),
                                **extra)
    except ValidationError as e:
        err = flag_error(e)
        field = e.errors(include_url=False)[0]["loc"][0]
        if field in ("min_temp", "max_temp", "temp_exponent"):   # no flag of their own: -dyntemp sets them
            err = ConfigError(str(err).replace(f"--{field}:", f"--dynamic-temperature ({field}):", 1))
        raise err from None


def resolve_model_dir(model_dir: str | None) -> Path:
    if model_dir:
        return Path(model_dir)
    from exl2.models.default_model import default_model_dir
    return default_model_dir()


@contextmanager
def load_bar() -> Iterator[Optional[Callable[[str, int, int], None]]]:
    """While a model loads, a progress bar on stderr (a terminal only; it clears when done): yields the
    `progress(kind, done, total)` callback `Engine` takes, or None where stderr is not a terminal."""
    if not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    with Progress(TextColumn("loading the {task.description}"), BarColumn(), MofNCompleteColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        tasks: dict[str, int] = {}

        def progress(kind: str, done: int, total: int) -> None:
            if kind not in tasks:
                tasks[kind] = bar.add_task(kind, total=total)
            bar.update(tasks[kind], completed=done)
        yield progress


def load_generator(args):
    """(model_dir, tokenizer, generator) for the model flags of generate/chat, with the --lora adapters
    applied."""
    from exl2.generation.generator import Generator
    from exl2.generation.speculative import make_drafter
    from exl2.generation.tokenizer import Tokenizer
    from exl2.runtime.load_progress import reporting, tagged
    from exl2.runtime.loader import context_length, load_model
    from exl2.runtime.lora import LoraAdapter, set_loras
    from exl2.runtime.placement import parse_gpu_split

    split = parse_gpu_split(args.gpu_split)
    rope = rope_from_args(args)
    loras = lora_specs(args)
    model_dir = resolve_model_dir(args.model_dir)
    with load_bar() as hear:
        model = load_model(model_dir, args.device, gpu_split=split, cache_tokens=args.max_seq_len,
                           cache_mode=args.cache_mode, tensor_parallel=args.tensor_parallel, rope=rope,
                           experts_per_token=args.experts_per_token, prefill_fp8=args.prefill_fp8,
                           progress=tagged(hear, "model"))
    if loras:   # before the generator exists: no graph or cached prefix was made without them
        set_loras(model, [LoraAdapter.from_dir(s.path, model, s.scaling) for s in loras])
    tok = Tokenizer.from_dir(model_dir)
    max_seq_len = context_length(model.spec, args.max_seq_len)
    if not 1 <= args.num_draft_tokens <= 16:
        raise ConfigError("--draft_tokens must be between 1 and 16.")
    chunk = args.chunk_size if args.chunk_size is not None else CHUNK_DEFAULT
    if not CHUNK_MIN <= chunk <= CHUNK_MAX:
        raise ConfigError(f"--chunk_size must be between {CHUNK_MIN} and {CHUNK_MAX}.")
    with load_bar() if args.draft_model_dir else nullcontext() as hear, reporting(tagged(hear, "draft")):
        draft = make_drafter(model, args.ngram_draft, args.draft_model_dir, max_seq_len, args.cache_mode,
                             args.num_draft_tokens, draft_rope_from_args(args))
    return model_dir, tok, Generator(model, tok, max_seq_len, args.cache_mode, draft=draft,
                                     num_draft_tokens=args.num_draft_tokens, chunk=chunk,
                                     use_graphs=not args.no_graphs)
