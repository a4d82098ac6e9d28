"""``mooncake://host:port[?option=value&...]`` addresses: the prefix level
(:func:`jax_tpusync.mooncake.level.make_level`) and the weight store
(:meth:`jax_tpusync.weights.store_mooncake.MooncakeWeightStore.from_url`) are named by one,
each with options of its own.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")

EXPECTED = "expected 'mooncake://host:port[?option=value&...]'"

# An option of an address: (the keyword argument it gives, how its text becomes the value).
Option = tuple[str, Callable[[str], Any]]


def megabytes(text: str) -> int:
    """An option given in MiB, as bytes."""
    return int(text) << 20


def kilobytes(text: str) -> int:
    """An option given in KiB, as bytes."""
    return int(text) << 10


def open_url(url: str, what: str, options: Mapping[str, Option], make: Callable[..., T]) -> T:
    """``make(master, **keyword arguments)`` for ``url``: ``master`` is its ``host:port``
    (an IPv6 host in brackets), each option of the query gives its keyword argument
    (``options``: by option name, in the order an unknown option's error lists them; the
    last of a repeated option wins).

    A ValueError names ``what`` (``"remote level"``, ``"weight store"``), the URL and what
    is wrong in it: not a ``mooncake://host:port`` address, a malformed query, an unknown
    option or one whose value does not convert (empty values are refused by name, not
    dropped), or a ValueError of ``make`` itself."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # A ValueError if it is not a port number.
    except ValueError as e:
        raise ValueError(f"{what} {url!r}: {e} ({EXPECTED})") from None
    if (
        parts.scheme != "mooncake"
        or not parts.hostname
        or port is None
        or parts.path not in ("", "/")
    ):
        raise ValueError(f"{what} {url!r}: {EXPECTED}")
    try:
        query = urllib.parse.parse_qs(
            parts.query, keep_blank_values=True, strict_parsing=bool(parts.query)
        )
    except ValueError as e:
        raise ValueError(f"{what} {url!r}: {e} (expected option=value&...)") from None
    arguments: dict[str, Any] = {}
    for name, values in query.items():
        value = values[-1]
        try:
            if name not in options:
                raise ValueError(f"known options: {', '.join(options)}")
            keyword, convert = options[name]
            arguments[keyword] = convert(value)
        except ValueError as e:
            raise ValueError(f"{what} {url!r}: option {name}={value!r}: {e}") from None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    try:
        return make(f"{host}:{port}", **arguments)
    except ValueError as e:
        raise ValueError(f"{what} {url!r}: {e}") from None
