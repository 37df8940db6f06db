"""Text <-> token ids for a Hugging Face model directory, plus a streaming decoder that never splits a character.

`tokenizer.json` (the `tokenizers` package) is preferred; `tokenizer.model` (sentencepiece) is the fallback.
Special-token ids and the chat template come from `tokenizer_config.json`, `generation_config.json` and
`config.json`, the way transformers reads them.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from exl2.errors import ModelLoadError

_REPLACEMENT = "\ufffd"
# A multi-byte character spans at most 4 byte tokens; past this many held-back tokens the bytes are truly invalid.
_MAX_PENDING = 8


def read_json(path: Path) -> dict:
    """A JSON object file's contents; {} when the file is missing or holds no object."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise ModelLoadError(f"{path} is not valid JSON.") from None
    return data if isinstance(data, dict) else {}


def _token_content(tok: Any) -> Optional[str]:
    """tokenizer_config stores special tokens as strings or as AddedToken dicts."""
    if isinstance(tok, str):
        return tok
    if isinstance(tok, dict) and isinstance(tok.get("content"), str):
        return tok["content"]
    return None


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _pick_template(value: Any) -> Optional[str]:
    """A template string, or the 'default' (else first) of a list of named templates."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default") or next((t for t in named.values() if isinstance(t, str)), None)
        return chosen if isinstance(chosen, str) else None
    return None


class _HFBackend:
    """tokenizers.Tokenizer wrapper; keeps a second copy that treats special-token text as plain text."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self.tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception subclass
            raise ModelLoadError(f"{path} cannot be read as a tokenizers file ({e}).") from None
        self._plain = None

    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> Optional[int]:
        return self.tok.token_to_id(token)

    def id_to_piece(self, i: int) -> Optional[str]:
        return self.tok.id_to_token(i)

    def special_ids(self) -> set[int]:
        return {i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}

    def encode(self, text: str, special: bool) -> list[int]:
        tok = self.tok
        if not special:
            if self._plain is None:
                from tokenizers import Tokenizer as HFTokenizer

                self._plain = HFTokenizer.from_str(self.tok.to_str())
                self._plain.encode_special_tokens = True
            tok = self._plain
        return tok.encode(text, add_special_tokens=False).ids

    def encode_processed(self, text: str) -> list[int]:
        """`text` with the post-processor's special tokens (special-token text parsed as those tokens)."""
        return self.tok.encode(text, add_special_tokens=True).ids

    def adds_bos(self, bos_id: Optional[int]) -> bool:
        """Whether the post-processor prepends BOS (the model's rule when tokenizer_config is silent)."""
        if bos_id is None:
            return False
        with_special = self.tok.encode("a", add_special_tokens=True).ids
        return bool(with_special) and with_special[0] == bos_id

    def decode(self, ids: Sequence[int], skip_special: bool) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)

    def texts(self) -> list[str]:
        """Every token decoded alone; the batch decoder keeps a 128k vocabulary well under a second."""
        return self.tok.decode_batch([[i] for i in range(self.vocab_size())], skip_special_tokens=False)


class _SPBackend:
    """sentencepiece model plus the added tokens of tokenizer_config.json, which sentencepiece does not know."""

    def __init__(self, path: Path, added: dict[int, dict]):
        import sentencepiece as spm

        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(path))
        except Exception as e:  # sentencepiece raises RuntimeError/OSError variants
            raise ModelLoadError(f"{path} cannot be read as a sentencepiece model ({e}).") from None
        n = self.sp.get_piece_size()
        self.added = {i: t["content"] for i, t in added.items() if isinstance(t.get("content"), str)}
        self.added_special = {i for i, t in added.items() if t.get("special", True)}
        self.added_ids = {c: i for i, c in self.added.items()}
        self._split = (
            re.compile("(" + "|".join(re.escape(c) for c in sorted(self.added_ids, key=len, reverse=True)) + ")")
            if self.added_ids else None
        )
        self._n = max([n - 1, *self.added]) + 1
        ctrl = {i for i in range(n) if self.sp.is_control(i) or self.sp.is_unknown(i)}
        self._special = ctrl | self.added_special

    def vocab_size(self) -> int:
        return self._n

    def token_to_id(self, token: str) -> Optional[int]:
        if token in self.added_ids:
            return self.added_ids[token]
        i = self.sp.piece_to_id(token)
        return i if self.sp.id_to_piece(i) == token else None

    def id_to_piece(self, i: int) -> Optional[str]:
        if i in self.added:
            return self.added[i]
        return self.sp.id_to_piece(i) if 0 <= i < self.sp.get_piece_size() else None

    def special_ids(self) -> set[int]:
        return self._special

    def encode(self, text: str, special: bool) -> list[int]:
        if not special or self._split is None:
            return list(self.sp.encode(text))
        out: list[int] = []
        for part in self._split.split(text):
            if part in self.added_ids:
                out.append(self.added_ids[part])
            elif part:
                out.extend(self.sp.encode(part))
        return out

    def adds_bos(self, bos_id: Optional[int]) -> bool:
        return bos_id is not None  # sentencepiece llama-style models add BOS unless told otherwise

    def decode(self, ids: Sequence[int], skip_special: bool) -> str:
        skip = self._special if skip_special else set()
        text, run = [], []
        for i in ids:
            if i in skip:
                continue
            if i in self.added or not 0 <= i < self.sp.get_piece_size() or self.sp.is_control(i):
                if run:
                    text.append(self.sp.decode(run))
                    run = []
                text.append(self.id_to_piece(i) or "")
            else:
                run.append(i)
        if run:
            text.append(self.sp.decode(run))
        return "".join(text)

    def texts(self) -> list[str]:
        return [self.decode([i], False) for i in range(self._n)]


class Tokenizer:
    """The tokenizer of one model directory: encode, decode, special ids, chat template."""

    def __init__(self, backend, config: dict, gen_ids: dict[str, list[int]], chat_template: Optional[str]):
        self._b = backend
        self._cfg = config

        def resolve(name: str) -> Optional[int]:
            content = _token_content(config.get(f"{name}_token"))
            if content is not None:
                i = backend.token_to_id(content)
                if i is not None:
                    return i
            ids = gen_ids.get(name) or []
            return ids[0] if ids else None

        self.bos_id: Optional[int] = resolve("bos")
        self.pad_id: Optional[int] = resolve("pad")
        eos = list(gen_ids.get("eos") or [])
        main = resolve("eos")
        self._eos_main = main if main is not None else (eos[0] if eos else None)
        self.eos_ids: set[int] = set(eos) | ({main} if main is not None else set())
        self.chat_template: Optional[str] = chat_template
        listed = config.get("chat_template")
        # tokenizer_config.json's named templates besides the default (Command-R's and Hermes' tool_use, rag)
        self.named_templates: dict[str, str] = {
            t["name"]: t["template"] for t in (listed if isinstance(listed, list) else [])
            if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
        add_bos = config.get("add_bos_token")
        self._add_bos = bool(add_bos) if isinstance(add_bos, bool) else backend.adds_bos(self.bos_id)
        self._special_ids = backend.special_ids()
        self._texts: Optional[list[str]] = None

    @classmethod
    def from_dir(cls, model_dir: Path | str) -> "Tokenizer":
        d = Path(model_dir)
        if not d.is_dir():
            raise ModelLoadError(f"Model directory {d} does not exist.")
        config = read_json(d / "tokenizer_config.json")
        if (d / "tokenizer.json").is_file():
            backend = _HFBackend(d / "tokenizer.json")
        elif (d / "tokenizer.model").is_file():
            added = {
                int(k): v for k, v in (config.get("added_tokens_decoder") or {}).items()
                if str(k).isdigit() and isinstance(v, dict)
            }
            backend = _SPBackend(d / "tokenizer.model", added)
        else:
            raise ModelLoadError(f"{d} has no tokenizer.json or tokenizer.model.")
        gen_ids: dict[str, list[int]] = {}
        # generation_config.json overrides config.json, but every EOS id either lists is a stop token.
        for src in (read_json(d / "config.json"), read_json(d / "generation_config.json")):
            for name in ("bos", "eos", "pad"):
                ids = _ids(src.get(f"{name}_token_id"))
                if name == "eos":
                    gen_ids["eos"] = sorted(set(gen_ids.get("eos", [])) | set(ids))
                elif ids:
                    gen_ids[name] = ids
        template = None
        tabby = d / "tabby_template.jinja"    # TabbyAPI's per-model override comes first
        if tabby.is_file():
            template = tabby.read_text(encoding="utf-8")
        if template is None:
            template = _pick_template(config.get("chat_template"))
        jinja = d / "chat_template.jinja"
        if template is None and jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        if template is None:  # processor-style repos (Mistral 3, Gemma 3) keep it in chat_template.json
            template = _pick_template(read_json(d / "chat_template.json").get("chat_template"))
        return cls(backend, config, gen_ids, template)

    @property
    def vocab_size(self) -> int:
        return self._b.vocab_size()

    @property
    def add_bos(self) -> bool:
        """The model's rule for prompts: prepend BOS or not."""
        return self._add_bos

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """bos_token, eos_token, … as strings, for chat templates."""
        out = {}
        for name in ("bos", "eos", "unk", "pad", "sep", "cls", "mask"):
            content = _token_content(self._cfg.get(f"{name}_token"))
            i = {"bos": self.bos_id, "eos": self._eos_main, "pad": self.pad_id}.get(name)
            if content is None and i is not None:
                content = self.id_to_piece(i)
            if content is not None:
                out[f"{name}_token"] = content
        return out

    @property
    def special_ids(self) -> set[int]:
        return set(self._special_ids)

    def token_to_id(self, token: str) -> Optional[int]:
        return self._b.token_to_id(token)

    def id_to_piece(self, token_id: int) -> Optional[str]:
        return self._b.id_to_piece(int(token_id))

    def encode(self, text: str, add_bos: Optional[bool] = None, special: bool = True) -> list[int]:
        """Token ids of `text`; `special` parses special-token text like '<|im_end|>' as those tokens."""
        ids = self._b.encode(text, special)
        want_bos = self._add_bos if add_bos is None else add_bos
        if want_bos and self.bos_id is not None and not (ids and ids[0] == self.bos_id):
            ids = [self.bos_id, *ids]
        return ids

    def encode_document(self, text: str) -> list[int]:
        """Token ids of `text` with every special token the tokenizer's post-processor adds (BOS, and for
        embedding models such as Qwen3-Embedding the end token their last-token pooling reads), as Hugging Face's
        tokenizer(text) gives them: how embedding models were trained to see a text."""
        post = getattr(self._b, "encode_processed", None)
        return post(text) if post is not None else self.encode(text)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        return self._b.decode([int(i) for i in ids], skip_special)

    def token_texts(self) -> list[str]:
        """The text of each token id decoded alone (specials included); cached, since every DRY request needs it."""
        if self._texts is None:
            self._texts = list(self._b.texts())
        return self._texts

    def stream_decoder(self, skip_special: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special)


class StreamDecoder:
    """Turns a stream of token ids into text pieces that never end inside a UTF-8 character.

    Decodes only the tokens since the last emitted boundary (plus one window of context, so that tokenizers
    that strip a leading space at the start of a sequence decode the same as in the full text).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tok = tokenizer
        self._skip = skip_special
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # end of what has been emitted

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        return self._emit(force=False)

    def flush(self) -> str:
        """Whatever is still held back (e.g. bytes of an incomplete character at the end of generation)."""
        return self._emit(force=True)

    def _emit(self, force: bool) -> str:
        ids = self._ids
        if self._read >= len(ids):
            return ""
        dec = self._tok.decode
        done = dec(ids[self._prefix:self._read], self._skip) if self._read > self._prefix else ""
        full = dec(ids[self._prefix:], self._skip)
        pending = len(ids) - self._read
        if full.endswith(_REPLACEMENT) and not force and pending < _MAX_PENDING:
            return ""
        if not full.startswith(done):
            # Context-dependent decoders (rare): fall back to the common prefix so nothing is duplicated.
            n = 0
            while n < min(len(done), len(full)) and done[n] == full[n]:
                n += 1
            delta = full[n:]
        else:
            delta = full[len(done):]
        self._prefix, self._read = self._read, len(ids)
        # Drop history nobody will look at again; keeps push() O(1) per token.
        if self._prefix > 64:
            del ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return delta
