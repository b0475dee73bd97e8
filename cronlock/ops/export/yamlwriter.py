"""A small YAML writer for `schedule export` (Kubernetes, compose).

PyYAML is a development dependency only; the service's output is simple enough to write by
hand: block mappings and sequences, `|` for scripts, JSON-quoted strings (JSON's string syntax
is YAML's double-quoted style, but for the characters YAML reads as line breaks or refuses).
tests/test_export.py checks that yaml.safe_load reads every output back equal.
"""

from __future__ import annotations

import json
import re
from typing import Any

_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_./-]*")
# Plain words YAML 1.1 (PyYAML) reads as booleans or null.
_YAML_WORDS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null", "~"}
_UNSAFE_IN_QUOTES = re.compile("[\x7f-\x9f\u2028\u2029\ufeff\ud800-\udfff\ufffe\uffff]")


def _quoted(text: str) -> str:
    return _UNSAFE_IN_QUOTES.sub(
        lambda m: f"\\u{ord(m.group()):04x}", json.dumps(text, ensure_ascii=False)
    )


def _scalar(value: Any) -> str:
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return {"nan": ".nan", "inf": ".inf", "-inf": "-.inf"}[repr(value)]
        text = repr(value)  # YAML 1.1 wants a dot in a float: 1e+16 is 1.0e+16
        return text if "." in text or "e" not in text else text.replace("e", ".0e")
    if isinstance(value, dict | list) and not value:
        return "{}" if isinstance(value, dict) else "[]"
    return _quoted(str(value))


def _key(key: str) -> str:
    plain = _PLAIN_KEY.fullmatch(key) and key.lower() not in _YAML_WORDS
    return key if plain else _quoted(key)


def _literal(text: str) -> bool:
    """Whether `text` can be a `|` block: several lines, no leading space (which would set the
    block's indentation), only characters a block keeps as they are."""
    return (
        "\n" in text
        and not text[0].isspace()
        and all(ch in "\t\n" or ch.isprintable() for ch in text)
    )


def _block(text: str, indent: int) -> str:
    pad = " " * indent
    lines = text.rstrip("\n")
    ending = len(text) - len(lines)  # trailing newlines: strip, clip or keep them
    chomp = "-" if ending == 0 else "" if ending == 1 else "+"
    body = "".join(f"{pad}{line}\n" if line else "\n" for line in lines.split("\n"))
    return f"|{chomp}\n{body}" + "\n" * max(ending - 1, 0)


def to_yaml(value: Any, indent: int = 0) -> str:
    """`value` (dicts with string keys, lists, strings, numbers, booleans, None) as YAML."""
    pad = " " * indent
    if not (isinstance(value, dict | list) and value):
        return pad + _scalar(value) + "\n"
    pairs = value.items() if isinstance(value, dict) else (("-", item) for item in value)
    out = []
    for key, item in pairs:
        head = f"{pad}{_key(key)}:" if isinstance(value, dict) else f"{pad}-"
        if isinstance(item, dict) and item and isinstance(value, list):
            out.append(f"{head} {to_yaml(item, indent + 2)[indent + 2 :]}")  # - key: value
        elif isinstance(item, dict | list) and item:
            out.append(f"{head}\n{to_yaml(item, indent + 2)}")
        elif isinstance(item, str) and _literal(item):
            out.append(f"{head} {_block(item, indent + 2)}")
        else:
            out.append(f"{head} {_scalar(item)}\n")
    return "".join(out)
