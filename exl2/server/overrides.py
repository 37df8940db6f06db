"""TabbyAPI's sampler overrides: a server-wide preset of request-field values, so whoever runs the server can set
defaults for every client (`override`: used where a request leaves the field out), enforce them (`force`: used
whatever the request sends) or put entries before a request's list (`additive`: e.g. stop strings, banned strings).

A preset is a YAML or JSON mapping from request fields (completions and chat share them: `SamplingFields`) to
either a plain value (an override) or `{override: value, force: bool, additive: bool}`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from exl2.errors import ConfigError
from exl2.server.errors import first_problem
from exl2.names import plain_name
from exl2.server.schemas import SamplingFields

Body = TypeVar("Body", bound=SamplingFields)
PRESET_SUFFIXES = (".yml", ".yaml", ".json")


class Override(BaseModel):
    """One field's rule."""

    model_config = ConfigDict(extra="forbid")

    override: Any
    force: bool = False
    additive: bool = False


class Overrides:
    """A preset's rules, each checked against the request schema when it is read."""

    def __init__(self, rules: dict[str, Override], name: Optional[str] = None):
        self.rules = rules
        self.name = name

    @classmethod
    def parse(cls, data: Any, name: Optional[str] = None) -> "Overrides":
        """Rules from a mapping (a preset file's content or an admin's request); ConfigError names what is wrong."""
        where = f"sampler override preset {name!r}" if name else "sampler overrides"
        if not isinstance(data, dict):
            raise ConfigError(f"The {where} must be a mapping of request fields to values.")
        fields = SamplingFields.model_fields
        rules = {}
        for key, value in data.items():
            if key not in fields or key in ("model", "stream", "stream_options", "n"):
                raise ConfigError(f"The {where} names {key!r}, which is not a sampling field of the request.")
            try:
                rule = Override.model_validate(value) if isinstance(value, dict) and "override" in value \
                    else Override(override=value)
                SamplingFields.model_validate({key: rule.override})
            except ValidationError as e:
                raise ConfigError(f"The {where} gives {key!r} a value the request schema refuses: "
                                  f"{first_problem(e)[1]}.") from None
            if rule.additive and not isinstance(rule.override, list):
                raise ConfigError(f"The {where} makes {key!r} additive, which needs a list value.")
            rules[key] = rule
        return cls(rules, name)

    @classmethod
    def from_file(cls, path: Path) -> "Overrides":
        """A preset file (.yml/.yaml or .json), named after its stem."""
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"The sampler override preset {str(path)!r} cannot be read ({e.strerror or e}).") \
                from None
        if path.suffix == ".json":
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigError(f"The sampler override preset {str(path)!r} is not valid JSON ({e}).") from None
        else:
            import yaml
            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as e:
                raise ConfigError(f"The sampler override preset {str(path)!r} is not valid YAML "
                                  f"({str(e).splitlines()[0]}).") from None
        return cls.parse(data if data is not None else {}, path.stem)

    def apply(self, body: Body) -> Body:
        """`body` with the rules applied: forced fields replaced, missing ones filled in, additive lists
        prefixed; the result is validated again, so a combination the schema refuses is the request's 400."""
        if not self.rules:
            return body
        sent = body.model_fields_set
        data = body.model_dump(exclude_unset=True)
        for key, rule in self.rules.items():
            if rule.force or key not in sent:
                data[key] = rule.override
            elif rule.additive:
                mine = data.get(key)
                mine = [] if mine is None else mine if isinstance(mine, list) else [mine]
                data[key] = list(rule.override) + [v for v in mine if v not in rule.override]
        return type(body).model_validate(data)

    def describe(self) -> dict[str, dict[str, Any]]:
        """The rules as plain data (for GET /v1/sampling/overrides)."""
        return {k: r.model_dump() for k, r in self.rules.items()}


def preset_names(directory: Optional[Path]) -> list[str]:
    """The presets (files with a preset suffix) in `directory`, by name."""
    if directory is None or not directory.is_dir():
        return []
    return sorted(p.stem for p in directory.iterdir() if p.is_file() and p.suffix in PRESET_SUFFIXES
                  and not p.name.startswith("."))


def find_preset(directory: Optional[Path], name: str) -> Path:
    """The file of preset `name` in `directory` (a plain name: it cannot reach outside); ConfigError if none."""
    if directory is None:
        raise ConfigError("Sampler override presets need a preset directory (--sampler-override-dir).")
    if not plain_name(name):
        raise ConfigError(f"{name!r} is not the name of a sampler override preset.")
    for suffix in PRESET_SUFFIXES:
        path = directory / f"{name}{suffix}"
        if path.is_file():
            return path
    raise ConfigError(f"There is no sampler override preset {name!r} in {directory}.")


def startup_overrides(config) -> Overrides:
    """The preset a server starts with (`ServerConfig.sampler_override`: a preset name in the preset directory,
    or a preset file's path); none when unset."""
    name = config.sampler_override
    if not name:
        return Overrides({})
    path = Path(name)
    if path.suffix in PRESET_SUFFIXES and path.is_file():
        return Overrides.from_file(path)
    return Overrides.from_file(find_preset(config.sampler_override_dir, name))
