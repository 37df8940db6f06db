"""Fill-in-the-middle prompts (`generation.fim`, the legacy completions' `suffix`): each family's markers in its
order around the tokenized prefix and suffix, special-token text inside them kept as text, BOS where the model
wants it; a tokenizer without FIM tokens, or token-id prompts, are a 400 blaming `suffix`."""
import asyncio
import shutil
from types import SimpleNamespace

import httpx
import pytest
from tokenizers import Tokenizer as HFTokenizer

from test_cli import SRC
from test_server import FakeEngine

from exl2.config import ServerConfig
from exl2.errors import ConfigError
from exl2.generation.fim import fim_format, fim_prompt
from exl2.generation.tokenizer import Tokenizer
from exl2.server.app import create_app

QWEN = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


@pytest.fixture(scope="module")
def fim_tokenizer(tmp_path_factory) -> Tokenizer:
    """The golden model's tokenizer with Qwen2.5-Coder's three FIM tokens added."""
    d = tmp_path_factory.mktemp("fimtok")
    hf = HFTokenizer.from_file(str(SRC / "tokenizer.json"))
    hf.add_special_tokens(list(QWEN))
    hf.save(str(d / "tokenizer.json"))
    shutil.copy(SRC / "tokenizer_config.json", d)
    return Tokenizer.from_dir(d)


def test_prefix_suffix_middle_with_a_real_tokenizer(fim_tokenizer):
    t = fim_tokenizer
    pre, suf, mid = (t.token_to_id(m) for m in QWEN)
    ids = fim_prompt(t, "def add(a, b):\n    ", "\n    return c")
    body = [pre, *t.encode("def add(a, b):\n    ", add_bos=False), suf, *t.encode("\n    return c", add_bos=False),
            mid]
    assert ids == ([t.bos_id] if t.add_bos else []) + body
    # marker text inside the code stays text: it is not the marker token
    sneaky = fim_prompt(t, "x = '<|fim_suffix|>'", "")
    assert sneaky.count(suf) == 1


class _Vocab(SimpleNamespace):
    """A tokenizer of one id per character (100 + its code) and the given marker tokens."""

    def token_to_id(self, token):
        return self.markers.get(token)

    def encode(self, text, add_bos=None, special=True):
        return [100 + ord(c) for c in text]


def test_deepseek_and_codestral_orders():
    deepseek = _Vocab(markers={"<｜fim▁begin｜>": 1, "<｜fim▁hole｜>": 2, "<｜fim▁end｜>": 3}, add_bos=True, bos_id=0)
    assert fim_prompt(deepseek, "a", "b") == [0, 1, 100 + ord("a"), 2, 100 + ord("b"), 3]
    codestral = _Vocab(markers={"[PREFIX]": 5, "[SUFFIX]": 6}, add_bos=True, bos_id=0)
    assert fim_prompt(codestral, "a", "b") == [0, 6, 100 + ord("b"), 5, 100 + ord("a")]
    none = _Vocab(markers={}, add_bos=False, bos_id=None)
    assert fim_format(none) is None
    with pytest.raises(ConfigError, match="no fill-in-the-middle tokens"):
        fim_prompt(none, "a", "b")


def test_server_suffix(fim_tokenizer):
    fake = FakeEngine()
    fake.reply = "c = a + b"
    fake.tokenizer = fim_tokenizer
    plain = FakeEngine()
    plain.tokenizer = Tokenizer.from_dir(SRC)

    async def go():
        c = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(fake, ServerConfig())),
                              base_url="http://test")
        r = await c.post("/v1/completions", json={"prompt": "def add(a, b):\n    ", "suffix": "\n    return c",
                                                  "max_tokens": 8, "echo": True})
        assert r.status_code == 200, r.text
        assert fake.prompts[-1] == fim_prompt(fim_tokenizer, "def add(a, b):\n    ", "\n    return c")
        assert r.json()["choices"][0]["text"].startswith("def add(a, b):\n    ")     # echo: the prompt as sent
        r = await c.post("/v1/completions", json={"prompt": [1, 2, 3], "suffix": "x", "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
        c2 = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(plain, ServerConfig())),
                               base_url="http://test")
        r = await c2.post("/v1/completions", json={"prompt": "a", "suffix": "b", "max_tokens": 4})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "suffix" and "fill-in-the-middle" in err["message"]

    asyncio.run(go())
