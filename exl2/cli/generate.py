"""`exl2 generate`: a plain completion (no chat template) printed to stdout as it streams."""
from __future__ import annotations

import sys

from exl2.cli.common import (add_draft_args, add_lora_args, add_model_args, add_sampling_args, load_generator,
                             sampling_from_args)


def register(sub) -> None:
    p = sub.add_parser("generate", help="complete a prompt (no chat template)",
                       description="Complete a prompt and print only the generated continuation.")
    add_model_args(p)
    add_lora_args(p)
    add_draft_args(p)
    p.add_argument("-p", "--prompt", required=True, help="text to complete")
    p.add_argument("-n", "--max-new-tokens", "--max_new_tokens", dest="max_new_tokens", type=int, default=128,
                   help="maximum number of tokens to generate (default 128)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--min-new-tokens", dest="min_new_tokens", type=int, default=0,
                   help="generate at least this many tokens: no end token or stop string ends the text sooner")
    p.add_argument("--ignore-eos", action="store_true",
                   help="never sample the end-of-sequence token: generate until -n tokens or a stop string")
    p.add_argument("--cfg-scale", "--cfg_scale", dest="cfg_scale", type=float, default=1.0,
                   help="classifier-free guidance: sample from s·log p(text | prompt) + (1 − s)·log p(text | negative "
                        "prompt); above 1 steers away from --negative-prompt (default 1 = off)")
    p.add_argument("--negative-prompt", "--negative_prompt", dest="negative_prompt", default=None,
                   help="what --cfg-scale steers away from (default: the BOS token alone)")
    add_sampling_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    settings = sampling_from_args(args, cfg_scale=args.cfg_scale)
    _, _, gen = load_generator(args)
    for text, _ in gen.stream(args.prompt, settings, args.max_new_tokens, args.stop,
                              min_new_tokens=args.min_new_tokens, ignore_eos=args.ignore_eos,
                              negative_prompt=args.negative_prompt):
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0
