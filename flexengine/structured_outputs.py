"""StructuredOutputsParams: vLLM's names and semantics for constrained decoding, validated on construction.

Exactly one constraint: `json` (a JSON schema, as a dict or a JSON string), `regex`, `choice` (a list of
strings, the output is one of them), `grammar` (EBNF, xgrammar's dialect) or `json_object=True` (any JSON
object or array). Light on purpose: the API process builds these without torch or xgrammar; the engine
compiles them (engine/structured_outputs.py).
"""
from __future__ import annotations

import json as _json
from dataclasses import dataclass

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False         # JSON without optional whitespace
    disable_additional_properties: bool = False  # objects of the schema take only the properties it names
    whitespace_pattern: str | None = None        # vLLM's name; xgrammar cannot honour it (refused)
    structural_tag: str | None = None            # not supported (refused)

    def __post_init__(self):
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported by the xgrammar backend "
                             "(use disable_any_whitespace)")
        if self.structural_tag is not None:
            raise ValueError("structured_outputs.structural_tag is not supported")
        given = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(CONSTRAINTS)}; "
                             f"got {', '.join(given) or 'none'}")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be a bool, got {getattr(self, name)!r}")
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = _json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"structured_outputs.json must be a JSON schema (an object), got "
                                 f"{type(schema).__name__}")
            try:
                _json.dumps(schema)
            except (TypeError, ValueError) as e:
                raise ValueError(f"structured_outputs.json is not JSON-serializable: {e}") from None
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or \
                    not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        return next(name for name in CONSTRAINTS if getattr(self, name) not in (None, False))

    def schema(self) -> dict | bool:
        """The JSON schema of a `json` constraint, parsed, with disable_additional_properties applied."""
        schema = _json.loads(self.json) if isinstance(self.json, str) else self.json
        return no_additional_properties(schema) if self.disable_additional_properties else schema

    def key(self) -> str:
        """The canonical text of what compiles to one grammar: equal keys, equal grammars. A schema's
        properties keep their order (it is the order the output takes)."""
        value = {"json": lambda: self.schema(), "regex": lambda: self.regex, "choice": lambda: self.choice,
                 "grammar": lambda: self.grammar, "json_object": lambda: True}[self.kind]()
        return _json.dumps([self.kind, value, self.disable_any_whitespace], separators=(",", ":"), ensure_ascii=False)


def no_additional_properties(schema):
    """The schema with `additionalProperties: false` on every object that does not say otherwise (vLLM's
    disable_additional_properties)."""
    if isinstance(schema, list):
        return [no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: no_additional_properties(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
