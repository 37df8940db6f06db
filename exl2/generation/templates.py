"""Which chat template a model runs with: its own, or one chosen by name or file (TabbyAPI's `prompt_template`).

A choice is a path to a Jinja file, or a name looked up as `<name>.jinja` in a template directory (the server's
`--template-dir`), then among the bundled templates, then among the named templates a tokenizer_config.json may
list (Command-R's and Hermes' `tool_use`, `rag`). Base models have no template; ChatML is then the fallback.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from exl2.errors import ConfigError
from exl2.generation.chat import CHATML_TEMPLATE, ChatTemplate
from exl2.names import plain_name

# Alpaca's instruction format; system text goes first, as a preamble.
ALPACA_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}### Instruction:\n{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'assistant' %}### Response:\n{{ message['content'] }}{{ eos_token }}\n\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}### Response:\n{% endif %}"
)

BUNDLED = {"chatml": CHATML_TEMPLATE, "alpaca": ALPACA_TEMPLATE}


def template_names(template_dir: Optional[Path] = None, tokenizer=None) -> list[str]:
    """Every name `choose_template` accepts: the directory's `.jinja` files, the bundled templates and the
    tokenizer's named ones, sorted."""
    names = set(BUNDLED)
    if template_dir is not None and template_dir.is_dir():
        names |= {p.stem for p in template_dir.glob("*.jinja") if p.is_file() and not p.name.startswith(".")}
    if tokenizer is not None:
        names |= set(tokenizer.named_templates)
    return sorted(names)


def template_file(template_dir: Optional[Path], choice: Optional[str]) -> Optional[str]:
    """`choice` with a name found in `template_dir` replaced by that file's path (what an EngineConfig, which
    knows no template directory, can load); anything else unchanged."""
    if choice and template_dir is not None and plain_name(choice) and (template_dir / f"{choice}.jinja").is_file():
        return str(template_dir / f"{choice}.jinja")
    return choice


def choose_template(tokenizer, choice: Optional[str] = None, template_dir: Optional[Path] = None) -> ChatTemplate:
    """The chat template `choice` names (None: the model's own); a name or file that does not exist, or a
    template that does not compile, is a one-sentence ConfigError."""
    if not choice:
        return ChatTemplate.from_tokenizer(tokenizer)
    source, origin = _source(tokenizer, choice, template_dir)
    template = ChatTemplate(source, special_tokens=tokenizer.special_tokens_map)
    template.name = origin
    return template


def _source(tokenizer, choice: str, template_dir: Optional[Path]) -> tuple[str, str]:
    """(template text, its name) of `choice`."""
    if not plain_name(choice) or choice.endswith(".jinja"):
        path = Path(choice).expanduser()
        if not path.is_file():
            raise ConfigError(f"The prompt template file {choice} does not exist.")
        return _read(path), path.stem
    if template_dir is not None and template_dir.is_dir():
        path = template_dir / f"{choice}.jinja"
        if path.is_file():
            return _read(path), choice
    if choice in BUNDLED:
        return BUNDLED[choice], choice
    named = tokenizer.named_templates
    if choice in named:
        return named[choice], choice
    raise ConfigError(f"There is no prompt template named '{choice}'; the names are: "
                      f"{', '.join(template_names(template_dir, tokenizer))}.")


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"The prompt template {path} cannot be read ({e.__class__.__name__}).") from None
