"""`exl2 embed`: embedding vectors of texts as JSON lines, or their cosine similarities to the first text."""
from __future__ import annotations

import json
import sys

from exl2.cli.common import add_model_args
from exl2.errors import ConfigError


def register(sub) -> None:
    p = sub.add_parser("embed", help="embedding vectors of texts (JSON lines), or their similarities",
                       description="Embed texts with a model (an embedding model such as Qwen3-Embedding; any "
                                   "model's pooled hidden states otherwise): one JSON object per text, "
                                   '{"index", "text", "tokens", "embedding"}; with --similarity, each text\'s cosine '
                                   "similarity to the first.")
    add_model_args(p)
    p.add_argument("-p", "--text", dest="texts", action="append", default=[], metavar="TEXT",
                   help="a text to embed (repeatable)")
    p.add_argument("--file", default=None, help="embed each non-empty line of this file ('-': standard input)")
    p.add_argument("--dimensions", type=int, default=None, help="keep the first N components (Matryoshka models)")
    p.add_argument("--pooling", choices=["last", "mean", "cls"], default=None,
                   help="how hidden states are pooled (default: the model's sentence-transformers config, else "
                        "the last token)")
    p.add_argument("--similarity", action="store_true",
                   help="print each text's cosine similarity to the first instead of the vectors")
    p.set_defaults(func=run)


def _texts(args) -> list[str]:
    texts = list(args.texts)
    if args.file is not None:
        try:
            src = sys.stdin if args.file == "-" else open(args.file, encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"Cannot read {args.file} ({e.strerror or e}).") from None
        with src:
            texts += [line.rstrip("\n") for line in src if line.strip()]
    if not texts:
        raise ConfigError("Give at least one text with -p or --file.")
    return texts


def run(args) -> int:
    from pydantic import ValidationError

    from exl2.cli.common import flag_error, load_bar, model_settings
    from exl2.config import EngineConfig
    from exl2.engine import Engine

    texts = _texts(args)
    settings = model_settings(args)
    if args.pooling is not None:
        settings["embedding_pooling"] = args.pooling
    try:
        config = EngineConfig(**settings, max_batch_size=1)
    except ValidationError as e:
        raise flag_error(e) from None
    with load_bar() as progress:
        engine = Engine(config, progress)
    try:
        result = engine.embed(texts, args.dimensions)
    finally:
        engine.close()
    vectors = result.vectors
    if args.similarity:
        sims = (vectors @ vectors[0]) / (vectors.norm(dim=1) * vectors[0].norm()).clamp_min(1e-12)
        for text, sim in zip(texts, sims.tolist()):
            print(f"{sim:.4f}\t{text}")
        return 0
    for i, (text, n, v) in enumerate(zip(texts, result.tokens, vectors.tolist())):
        print(json.dumps({"index": i, "text": text, "tokens": n, "embedding": v}))
    return 0
