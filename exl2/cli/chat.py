"""`exl2 chat`: an interactive console with streamed replies; also answers line by line from piped stdin."""
from __future__ import annotations

import sys

from exl2.cli.common import add_draft_args, add_model_args, add_sampling_args, load_generator, sampling_from_args

HELP = "Commands: /clear forgets the conversation, /exit quits (Ctrl-D too)."


def register(sub) -> None:
    p = sub.add_parser("chat", help="chat with a model in the terminal",
                       description="Interactive chat through the model's chat template. " + HELP)
    add_model_args(p)
    add_draft_args(p)
    p.add_argument("-sp", "--system_prompt", "--system-prompt", dest="system_prompt", default=None,
                   help="system prompt for the conversation")
    p.add_argument("-maxr", "--max_response_tokens", "--max-response-tokens", dest="max_response_tokens", type=int,
                   default=512, help="maximum tokens per reply (default 512)")
    add_sampling_args(p, temperature=0.7)
    p.set_defaults(func=run)


def run(args) -> int:
    from exl2.generation.chat import ChatTemplate

    settings = sampling_from_args(args)
    model_dir, tok, gen = load_generator(args)
    template = ChatTemplate.from_tokenizer(tok)
    interactive = sys.stdin.isatty()
    history: list[dict] = []
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
        history.append({"role": "user", "content": text})
        messages = ([{"role": "system", "content": args.system_prompt}] if args.system_prompt else []) + history
        prompt = template.render(messages, add_generation_prompt=True)
        if interactive:
            sys.stdout.write("Assistant> ")
        result = None
        for chunk, r in gen.stream(prompt, settings, args.max_response_tokens, add_bos=False):
            result = r or result
            if chunk:
                sys.stdout.write(chunk)
                sys.stdout.flush()
        sys.stdout.write("\n" if interactive else "\n\n")
        sys.stdout.flush()
        if interactive:
            print(_stats(result), file=sys.stderr)
        history.append({"role": "assistant", "content": result.text.strip()})
    return 0


def _stats(r) -> str:
    """One dim line after a reply: prompt (and how much of it the cache held), reply length, speeds."""
    speed = f", {(len(r.token_ids) - 1) / r.time_generate:.1f} tok/s" if r.time_generate > 0 else ""
    drafts = f", {r.accepted_draft_tokens}/{r.draft_tokens} guesses kept" if r.draft_tokens else ""
    return (f"[prompt {r.prompt_tokens} tokens ({r.cached_tokens} cached) in {r.time_prefill:.2f} s; "
            f"reply {len(r.token_ids)} tokens{speed}{drafts}]")
