"""How deeply a client's JSON may nest: one limit for the request body and for every JSON text found inside it
(earlier tool-call arguments, a schema sent as a string).

Code that walks client JSON recursively (jsonschema, the strict-schema rewrite, the chat template's ``tojson``,
llguidance, which stops at 128 levels as serde_json does) needs a bound below Python's recursion limit; without
one a deep schema ended as an HTTP 500. Past :data:`MAX_JSON_DEPTH` levels the request is a 400 naming the field.

This module must not import torch.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from ferrylm.errors import InvalidRequest

#: containers (objects and arrays) nested in one JSON document, the outermost counted: llguidance's limit
MAX_JSON_DEPTH = 128


def too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> list[str | int] | None:
    """The path (keys and indices) to the first container nested deeper than ``limit`` levels in ``value``, else
    None. Iterative: any depth is safe to look at."""
    stack: list[tuple[Any, tuple]] = [(value, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            items = node.items()
        elif isinstance(node, list):
            items = enumerate(node)
        else:
            continue
        if len(path) >= limit:
            return list(path)
        stack.extend((v, (*path, k)) for k, v in items if isinstance(v, (dict, list)))
    return None


def depth_error(param: str | None, limit: int = MAX_JSON_DEPTH) -> InvalidRequest:
    """The 400 for JSON nested deeper than ``limit`` levels in the field ``param`` (None: the body itself)."""
    where = f"'{param}'" if param else "the request body"
    return InvalidRequest(f"{where} nests JSON deeper than {limit} levels (objects and arrays inside each other), "
                          f"the most this server reads", param=param)


def check_json_depth(value: Any, param: str) -> None:
    """Raise InvalidRequest naming ``param`` when ``value`` nests deeper than :data:`MAX_JSON_DEPTH`."""
    if too_deep(value) is not None:
        raise depth_error(param)


def loads_json(text: str, param: str, *, parse_constant: Callable[[str], Any] | None = None) -> Any:
    """``json.loads(text)`` for a JSON text the client sent inside a field: InvalidRequest naming ``param`` for
    invalid JSON or nesting deeper than :data:`MAX_JSON_DEPTH` (never a RecursionError)."""
    try:
        value = json.loads(text, parse_constant=parse_constant)
    except RecursionError:
        raise depth_error(param) from None
    except ValueError as e:
        raise InvalidRequest(f"'{param}' is not valid JSON: {e}", param=param) from None
    check_json_depth(value, param)
    return value
