"""`exl2 chat`: an interactive console with streamed replies; also answers line by line from piped stdin."""
from __future__ import annotations

import sys
from typing import Callable, Optional

from exl2.cli.common import (add_draft_args, add_lora_args, add_model_args, add_sampling_args, add_template_arg,
                             load_generator, sampling_from_args)
from exl2.errors import ConfigError

HELP = ("Commands: /image FILE attaches an image to your next message (with --vision), /video FILE a video (Qwen "
        "vision models), /clear forgets the conversation, /exit quits (Ctrl-D too).")


def register(sub) -> None:
    p = sub.add_parser("chat", help="chat with a model in the terminal",
                       description="Interactive chat through the model's chat template. When the conversation "
                                   "outgrows the context, its oldest turns are dropped (the system prompt stays). "
                                   + HELP)
    add_model_args(p)
    add_template_arg(p)
    add_lora_args(p)
    add_draft_args(p)
    system = p.add_mutually_exclusive_group()
    system.add_argument("-sp", "--system_prompt", "--system-prompt", dest="system_prompt", default=None,
                        help="system prompt for the conversation")
    system.add_argument("-nsp", "--no_system_prompt", "--no-system-prompt", dest="no_system_prompt",
                        action="store_true",
                        help="send an empty system prompt, so the template's built-in default is left out too")
    p.add_argument("-maxr", "--max_response_tokens", "--max-response-tokens", dest="max_response_tokens", type=int,
                   default=512, help="maximum tokens per reply (default 512); the conversation leaves this much of "
                                     "the context free for the reply, at most half of it")
    p.add_argument("--vision", action="store_true",
                   help="load the model's vision tower, so /image can attach pictures (Mistral 3, Pixtral, Gemma 3, "
                        "Qwen2-VL, Qwen2.5-VL, Qwen3-VL) and /video videos (the Qwen models)")
    p.add_argument("--pan-and-scan", "--pan_and_scan", dest="pan_and_scan", action="store_true", default=None,
                   help="Gemma 3 with --vision: also read crops of images much wider or taller than square")
    p.add_argument("-amnesia", "--amnesia", dest="amnesia", action="store_true",
                   help="forget the conversation after every reply: each turn sees only the system prompt and "
                        "its own message")
    add_sampling_args(p, temperature=0.7)
    p.set_defaults(func=run)


def run(args) -> int:
    from exl2.generation.harmony import HarmonySplitter, is_harmony
    from exl2.generation.harmony import split as harmony_split
    from exl2.generation.multimodal import VisionPrompts, split_images, with_images
    from exl2.generation.templates import choose_template

    settings = sampling_from_args(args)
    model_dir, tok, gen = load_generator(args)
    template = choose_template(tok, args.prompt_template)
    harmony = is_harmony(template.source)
    interactive = sys.stdin.isatty()
    system = _system_messages(args)
    budget = reply_budget(args.max_response_tokens, gen.max_seq_len)
    history: list[dict] = []
    vision = VisionPrompts.load(model_dir, gen.model, args.pan_and_scan) if args.vision else None
    attached: list = []          # images and videos (VideoSource) for the next message (/image, /video)
    prompt_images: list = []     # the images of the prompt `encode` made last

    def encode(messages: list[dict]) -> list[int]:
        plain, sources = split_images(messages)
        text = template.render(plain, add_generation_prompt=True)
        prompt_images[:] = ()
        if not sources:
            return tok.encode(text, add_bos=False)
        ids, images = vision.prompt(text, tok, sources)
        prompt_images[:] = images
        return ids

    if interactive:
        print(f"exl2 chat: {model_dir.name} ({gen.model.spec.arch}). {HELP}", file=sys.stderr)
    while True:
        try:
            line = input("You> " if interactive else "")
        except EOFError:
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/clear":
            history.clear()
            if interactive:
                print("(conversation cleared)", file=sys.stderr)
            continue
        if text.startswith(("/image", "/video")):
            _attach(text[1:6], text[6:].strip(), vision, attached)
            continue
        user = {"role": "user", "content": text}
        if attached:
            user["content"] = with_images(text, attached)
            attached.clear()
        try:
            dropped, ids = fit_prompt(encode, system, history, user, gen.max_seq_len - budget)
        except ConfigError as e:   # an attached image that cannot be read
            print(f"error: {e}", file=sys.stderr)
            continue
        if dropped is None:
            print(f"error: This message makes a prompt of {len(ids)} tokens, but the context holds "
                  f"{gen.max_seq_len} tokens with {budget} kept for the reply; send a shorter one (or raise -l or "
                  "lower -maxr).", file=sys.stderr)
            continue
        if dropped:
            del history[:2 * dropped]
            print(f"(context full: dropped the {_turns(dropped)})", file=sys.stderr)
        if interactive:
            sys.stdout.write("Assistant> ")
        result = None
        channels = HarmonySplitter() if harmony else None   # gpt-oss: the answer on stdout, its analysis on stderr
        for chunk, r in gen.stream(ids, settings, args.max_response_tokens, images=prompt_images):
            result = r or result
            if channels is not None:
                thought, chunk = channels.push(chunk) if chunk else ("", "")
                if r is not None:
                    more, rest = channels.finish()
                    thought, chunk = thought + more, chunk + rest
                if thought and interactive:
                    sys.stderr.write(thought)
                    sys.stderr.flush()
            if chunk:
                sys.stdout.write(chunk)
                sys.stdout.flush()
        sys.stdout.write("\n" if interactive else "\n\n")
        sys.stdout.flush()
        if interactive:
            print(_stats(result), file=sys.stderr)
        if not args.amnesia:
            answer = harmony_split(result.text)[1] if harmony else result.text
            history += [user, {"role": "assistant", "content": answer.strip()}]
    return 0


def _attach(kind: str, path: str, vision, attached: list) -> None:
    """/image FILE or /video FILE (`kind`): queue a picture or video for the next message, or say in one line why
    not."""
    from pathlib import Path

    from exl2.generation.multimodal import VideoSource

    if vision is None:
        print(f"error: /{kind} needs the model's vision tower: start exl2 chat with --vision.", file=sys.stderr)
    elif kind == "video" and getattr(vision.vision, "encode_video", None) is None:
        print("error: this model's vision tower reads still images only, not videos.", file=sys.stderr)
    elif not path or not Path(path).expanduser().is_file():
        print(f"error: /{kind} needs a{'n image' if kind == 'image' else ' video'} file; {path or 'none'!r} is not "
              "one.", file=sys.stderr)
    else:
        source = str(Path(path).expanduser())
        attached.append(VideoSource(source) if kind == "video" else source)
        print(f"({kind} attached to your next message: {path})", file=sys.stderr)


def _system_messages(args) -> list[dict]:
    """The system message every prompt starts with; -nsp sends an empty one because templates such as SmolLM2's
    and Qwen2.5's put in their own default when there is none."""
    if args.no_system_prompt:
        return [{"role": "system", "content": ""}]
    return [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []


def reply_budget(max_response_tokens: int, max_seq_len: int) -> int:
    """Context kept free for the reply. Capped at half the context so that a -maxr as large as the context (the
    default 512 with -l 512) still leaves room for a conversation; the engine shortens such a reply to fit."""
    return max(1, min(max_response_tokens, max_seq_len // 2))


def fit_prompt(encode: Callable[[list[dict]], list[int]], system: list[dict], history: list[dict], user: dict,
               limit: int) -> tuple[Optional[int], list[int]]:
    """(user/assistant pairs to drop from the front of `history`, prompt ids) for the longest recent conversation
    whose prompt is at most `limit` tokens: the newest turns matter most to the reply, and the system prompt and
    the message being answered are never dropped. Pairs is None when even those two alone are too long (the ids
    are then that shortest prompt, for the error)."""
    for pairs in range(len(history) // 2 + 1):
        ids = encode(system + history[2 * pairs:] + [user])
        if len(ids) <= limit:
            return pairs, ids
    return None, ids


def _turns(n: int) -> str:
    return "oldest turn" if n == 1 else f"{n} oldest turns"


def _stats(r) -> str:
    """One dim line after a reply: prompt (and how much of it the cache held), reply length, speeds."""
    speed = f", {(len(r.token_ids) - 1) / r.time_generate:.1f} tok/s" if r.time_generate > 0 else ""
    drafts = f", {r.accepted_draft_tokens}/{r.draft_tokens} guesses kept" if r.draft_tokens else ""
    return (f"[prompt {r.prompt_tokens} tokens ({r.cached_tokens} cached) in {r.time_prefill:.2f} s; "
            f"reply {len(r.token_ids)} tokens{speed}{drafts}]")
