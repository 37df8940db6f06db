"""`exl2 serve --config FILE`: TabbyAPI's config.yml read into the serve command's flags, so a TabbyAPI setup moves
over as it is. Flags given on the command line win over the file; keys that change nothing here are named once in
a warning; keys asking for what this server cannot do are a one-sentence error."""
from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any, Callable

from exl2.errors import ConfigError

log = logging.getLogger("exl2.server")

def _text(v: Any) -> str:
    if not isinstance(v, (str, int, float)) or isinstance(v, bool):
        raise TypeError("a string")
    return str(v)


def _number(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError("a number")
    return float(v)


def _integer(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError("a whole number")
    return v


def _flag(v: Any) -> bool:
    if not isinstance(v, bool):
        raise TypeError("true or false")
    return v


def _cache_mode(v: Any) -> str:
    mode = _text(v).lower()
    if mode not in ("fp16", "q8", "q6", "q4", "q3", "q2"):
        raise TypeError("one of FP16, Q8, Q6, Q4, Q3, Q2")
    return mode


def _split(v: Any) -> str:
    if not isinstance(v, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
        raise TypeError("a list of GB per GPU")
    return ",".join(str(float(x)) for x in v)


# (section, key) -> (the serve flag's dest, converter)
_KEYS: dict[tuple[str, str], tuple[str, Callable[[Any], Any]]] = {
    ("network", "host"): ("host", _text),
    ("network", "port"): ("port", _integer),
    ("network", "sse_ping_interval"): ("sse_ping_interval", _number),
    ("model", "model_dir"): ("model_dir_root", _text),
    ("model", "inline_model_loading"): ("inline_model_loading", _flag),
    ("model", "max_seq_len"): ("max_seq_len", _integer),
    ("model", "cache_size"): ("cache_size", _integer),
    ("model", "cache_mode"): ("cache_mode", _cache_mode),
    ("model", "tensor_parallel"): ("tensor_parallel", _flag),
    ("model", "gpu_split"): ("gpu_split", _split),
    ("model", "rope_scale"): ("rope_scale", _number),
    ("model", "chunk_size"): ("chunk_size", _integer),
    ("model", "max_batch_size"): ("max_batch_size", _integer),
    ("model", "prompt_template"): ("prompt_template", _text),
    ("model", "vision"): ("vision", _flag),
    ("model", "reasoning_start_token"): ("reasoning_start_token", _text),
    ("model", "reasoning_end_token"): ("reasoning_end_token", _text),
    ("draft_model", "draft_rope_scale"): ("draft_rope_scale", _number),
    ("draft_model", "draft_num_tokens"): ("num_draft_tokens", _integer),
    ("sampling", "override_preset"): ("sampler_override", _text),
    ("lora", "lora_dir"): ("lora_dir", _text),
    ("logging", "log_prompt"): ("log_prompt", _flag),
    ("logging", "log_generation_params"): ("log_generation_params", _flag),
}


def read_yaml(path: Path) -> dict:
    """The file's top-level mapping; a missing, unreadable or malformed file is a one-sentence ConfigError."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"The config file {path} does not exist.") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"The config file {path} cannot be read ({e.__class__.__name__}).") from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise ConfigError(f"The config file {path} is not valid YAML{at}.") from None
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(v, dict) or v is None for v in data.values()):
        raise ConfigError(f"The config file {path} must hold sections (network, model, ...) of key: value lines.")
    return data


def _file_settings(data: dict) -> tuple[dict[str, Any], list[str]]:
    """(flag dest -> value, the keys that change nothing here)."""
    out: dict[str, Any] = {}
    ignored: list[str] = []
    for section, keys in data.items():
        for key, value in (keys or {}).items():
            name = f"{section}.{key}"
            if value is None or (section, key) in {("model", "model_name"), ("draft_model", "draft_model_dir"),
                                                   ("embeddings", "embedding_model_dir"),
                                                   ("embeddings", "embedding_model_name"),
                                                   ("draft_model", "draft_model_name"), ("lora", "loras"),
                                                   ("model", "gpu_split_auto"), ("network", "disable_auth"),
                                                   ("model", "rope_alpha"), ("draft_model", "draft_rope_alpha")}:
                continue   # nothing set, or read together with other keys below
            known = _KEYS.get((section, key))
            if known is None:
                ignored.append(name)
                continue
            dest, convert = known
            try:
                out[dest] = convert(value)
            except TypeError as e:
                raise ConfigError(f"The config file's {name} must be {e}, not {value!r}.") from None
    return out, ignored


def _alpha(value: Any, name: str) -> float | None:
    """rope_alpha: a number, or "auto" (this server's default: an NTK alpha where the context asks for one)."""
    if value is None or (isinstance(value, str) and value.lower() == "auto"):
        return None
    try:
        return _number(value)
    except TypeError:
        raise ConfigError(f"The config file's {name} must be a number or auto, not {value!r}.") from None


def _joined(data: dict, section: str, root_key: str, name_key: str) -> str | None:
    """TabbyAPI names a model as a directory root plus a name inside it."""
    keys = data.get(section) or {}
    name = keys.get(name_key)
    if not name:
        return None
    root = keys.get(root_key) or ("models" if section in ("model", "embeddings") else None)
    return str(Path(root) / str(name)) if root else str(name)


def apply_config_file(args: argparse.Namespace, parser: argparse.ArgumentParser) -> argparse.Namespace:
    """`args` with the config file's settings wherever the command line left the flag at its default (a flag given
    with its default value counts as not given)."""
    path = Path(args.config).expanduser()
    data = read_yaml(path)
    settings, ignored = _file_settings(data)
    model = data.get("model") or {}
    draft = data.get("draft_model") or {}
    settings["rope_alpha"] = _alpha(model.get("rope_alpha"), "model.rope_alpha")
    settings["draft_rope_alpha"] = _alpha(draft.get("draft_rope_alpha"), "draft_model.draft_rope_alpha")
    if model.get("gpu_split_auto") and "gpu_split" not in settings:
        settings["gpu_split"] = "auto"
    settings["model_dir"] = _joined(data, "model", "model_dir", "model_name")
    settings["draft_model_dir"] = _joined(data, "draft_model", "draft_model_dir", "draft_model_name")
    settings["embedding_model"] = _joined(data, "embeddings", "embedding_model_dir", "embedding_model_name")
    loras = (data.get("lora") or {}).get("loras") or []
    if loras:
        root = Path((data.get("lora") or {}).get("lora_dir") or "loras")
        if not isinstance(loras, list) or not all(isinstance(x, dict) and x.get("name") for x in loras):
            raise ConfigError("The config file's lora.loras must be a list of {name, scaling} entries.")
        settings["loras"] = [str(root / str(x["name"])) for x in loras]
        try:
            settings["lora_scaling"] = [_number(x.get("scaling", 1.0)) for x in loras]
        except TypeError:
            raise ConfigError("The config file's lora.loras scalings must be numbers.") from None
    out = vars(args).copy()
    for dest, value in settings.items():
        if value is not None and dest in out and out[dest] == parser.get_default(dest):
            out[dest] = value
    if ignored:
        log.warning("config file %s: ignored, as they change nothing in exl2: %s.", path, ", ".join(ignored))
    return argparse.Namespace(**out)
