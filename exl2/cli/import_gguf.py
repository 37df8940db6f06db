"""`exl2 import-gguf`: a GGUF file → an fp16 Hugging Face directory."""
from __future__ import annotations

from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("import-gguf", help="import a GGUF file as an fp16 Hugging Face model directory",
                       description="Dequantize a GGUF model and write safetensors, config.json, tokenizer.json and "
                                   "tokenizer_config.json (with the chat template).")
    p.add_argument("file", help="the .gguf file")
    p.add_argument("-o", "--output", required=True, help="output directory (created; must not hold another model)")
    p.set_defaults(func=run)


def run(args) -> int:
    from exl2.formats.gguf_import import import_gguf

    out = import_gguf(Path(args.file), Path(args.output))
    print(f"wrote {out}")
    return 0
