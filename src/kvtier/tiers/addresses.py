"""Addresses of remote backends, checked when the configuration loads.

Client libraries check host names later and each its own way (botocore
raises a bare ``ValueError`` when the client is built, redis-py fails only
on connect), so a URL or ``host:port`` either passes here or fails with a
message naming what is wrong, before any client sees it.
"""

from __future__ import annotations

import ipaddress
import re
import urllib.parse
from collections.abc import Collection

#: One label of a DNS name (RFC 1123): letters, digits and inner hyphens.
_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
#: The same with underscores, which resolvers accept (container service names).
_LABEL_UNDERSCORE = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")


def host_problem(host: str, *, underscores: bool = True) -> str | None:
    """What is wrong with a host name or IP address, or ``None``.

    ``underscores=False`` for clients that refuse them (botocore).
    """
    if not host:
        return "the address names no host"
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    if not host.isascii():
        return f"host {host!r} is not ASCII: write an international name in its xn-- (IDNA) form"
    label = _LABEL_UNDERSCORE if underscores else _LABEL
    labels = host.removesuffix(".").split(".")
    if len(host) > 253 or not all(label.fullmatch(part) for part in labels):
        allowed = (
            "letters, digits, '_' and inner '-'" if underscores else "letters, digits and inner '-'"
        )
        return f"host {host!r} is not a host name (labels of 1 to 63 {allowed}, joined by '.')"
    return None


def split_url(url: str, schemes: Collection[str]) -> urllib.parse.SplitResult:
    """``url`` split, its scheme one of ``schemes`` and its port valid.

    Raises ``ValueError`` saying what is wrong. The host is left to the
    caller (a ``unix://`` URL has none): check it with :func:`host_problem`.
    """
    if any(char.isspace() or not char.isprintable() for char in url):
        raise ValueError("the URL contains whitespace or a control character")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"not a valid URL ({exc})") from None
    if parts.scheme not in schemes:
        raise ValueError(f"the scheme must be one of {', '.join(s + '://' for s in schemes)}")
    if port == 0:
        raise ValueError("port 0 is not a server's port")
    return parts


def parse_host_port(text: str, *, allow_port_zero: bool = False) -> tuple[str, int]:
    """``host:port`` or ``[v6-address]:port`` as ``(host, port)``; ``ValueError`` if not."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not (port_text.isascii() and port_text.isdigit()):
        raise ValueError(f"{text!r} is not host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if ":" not in host:
            raise ValueError(f"{text!r}: brackets hold an IPv6 address only")
    elif ":" in host:
        raise ValueError(f"{text!r}: write an IPv6 address in brackets, [::1]:port")
    problem = host_problem(host)
    if problem:
        raise ValueError(f"{text!r}: {problem}")
    port = int(port_text)
    if not (0 if allow_port_zero else 1) <= port <= 65535:
        raise ValueError(f"{text!r}: port {port} out of range")
    return host, port


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (``localhost`` or a loopback address)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
