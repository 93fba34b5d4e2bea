"""Fetching remote media (``https://`` and ``http://`` image and video URLs of the OpenAI chat route) under a
policy, off by default.

The policy (vLLM's ``--allowed-media-domains`` has the same shape; the address checks follow OWASP's SSRF
prevention advice):

- only hosts in the allowed list are fetched (exact, case-insensitive host names or IP literals; an empty list
  fetches nothing);
- every address the host resolves to must be public: private, loopback, link-local, multicast, reserved and
  unspecified addresses are refused unless that address itself is listed (``127.0.0.1`` lets a test server on
  loopback be fetched; ``localhost`` alone does not);
- the connection goes to the address that was checked (the name is not resolved a second time, so a DNS answer
  that changes between the check and the connect cannot redirect it); for https the certificate is still checked
  against the host name (SNI);
- redirects are followed by hand, at most ``max_redirects``, each target checked as above;
- at most ``max_bytes`` are read (a larger ``Content-Length`` is refused before the body), and the whole fetch,
  redirects included, ends within ``timeout_s``.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from dataclasses import dataclass, field
from urllib.parse import urljoin, urlsplit

from specstream.errors import InvalidRequestError, MediaFetchError, MediaUrlNotAllowedError


@dataclass(frozen=True)
class FetchPolicy:
    """``allowed``: host names or IP literals (lower case); ``max_bytes``: body bytes at most; ``timeout_s``: the
    whole fetch (seconds); ``max_redirects``: redirects followed at most."""

    allowed: tuple[str, ...] = ()
    max_bytes: int = 64 * 1024 * 1024
    timeout_s: float = 10.0
    max_redirects: int = 3
    _hosts: frozenset = field(init=False, repr=False, compare=False, default=frozenset())

    def __post_init__(self):
        object.__setattr__(self, "_hosts", frozenset(h.strip().lower().strip("[]") for h in self.allowed if h.strip()))

    @property
    def enabled(self) -> bool:
        return bool(self._hosts)


def _public(addr: ipaddress._BaseAddress) -> bool:
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return not (addr.is_private or addr.is_loopback or addr.is_link_local or addr.is_multicast or addr.is_reserved
                or addr.is_unspecified)


def check_url(url: str, policy: FetchPolicy) -> tuple[str, str, int, str]:
    """(scheme, host, port, address to connect to) of ``url`` under ``policy``.

    Raises:
        MediaUrlNotAllowedError: not http(s), host not listed, or an address that is not public and not listed.
        MediaFetchError: the host name does not resolve.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise MediaUrlNotAllowedError(f"only http and https media URLs are fetched, not {scheme or '(none)'!r}")
    host = (parts.hostname or "").lower()
    if not host:
        raise MediaUrlNotAllowedError("the media URL has no host")
    if host not in policy._hosts:
        raise MediaUrlNotAllowedError(f"host {host!r} is not in the allowed media domains (--allowed-media-domains)")
    try:
        port = parts.port or (443 if scheme == "https" else 80)
    except ValueError:
        raise MediaUrlNotAllowedError("the media URL's port is not a number") from None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise MediaFetchError(f"cannot resolve {host!r}: {exc}") from None
    addrs = []
    for info in infos:
        addr = ipaddress.ip_address(info[4][0].split("%")[0])
        if not _public(addr) and str(addr) not in policy._hosts:
            raise MediaUrlNotAllowedError(f"host {host!r} resolves to {addr}, a private, loopback or reserved "
                                          "address that is not listed in the allowed media domains")
        addrs.append(addr)
    return scheme, host, port, str(addrs[0])


def fetch(url: str, policy: FetchPolicy, budget: int | None = None) -> tuple[bytes, str | None]:
    """(body, Content-Type) of ``url`` under ``policy``; ``budget``: bytes at most (default ``policy.max_bytes``).

    Raises:
        MediaUrlNotAllowedError: the URL, or a redirect's target, is refused by the policy.
        InvalidRequestError: the body is larger than the budget.
        MediaFetchError: connection error, timeout, an HTTP error status, too many redirects.
    """
    import httpx

    limit = policy.max_bytes if budget is None else min(budget, policy.max_bytes)
    deadline = time.monotonic() + policy.timeout_s
    for _ in range(policy.max_redirects + 1):
        scheme, host, port, address = check_url(url, policy)
        parts = urlsplit(url)
        literal = f"[{address}]" if ":" in address else address
        target = f"{scheme}://{literal}:{port}{parts.path or '/'}" + (f"?{parts.query}" if parts.query else "")
        left = deadline - time.monotonic()
        if left <= 0:
            raise MediaFetchError(f"fetching {url} took over {policy.timeout_s:g} s")
        headers = {"Host": parts.netloc.rsplit("@", 1)[-1], "Accept": "image/*, video/*"}
        try:
            with httpx.Client(timeout=httpx.Timeout(left), follow_redirects=False, trust_env=False) as client:
                with client.stream("GET", target, headers=headers,
                                   extensions={"sni_hostname": host} if scheme == "https" else {}) as resp:
                    if resp.status_code in (301, 302, 303, 307, 308) and "location" in resp.headers:
                        url = urljoin(url, resp.headers["location"])
                        continue
                    if resp.status_code != 200:
                        raise MediaFetchError(f"fetching {url}: HTTP {resp.status_code}")
                    declared = resp.headers.get("content-length")
                    if declared is not None and declared.isdigit() and int(declared) > limit:
                        raise InvalidRequestError(f"media at {url} is {declared} bytes, over {limit} "
                                                  "(max_upload_bytes)")
                    chunks, size = [], 0
                    for chunk in resp.iter_bytes():
                        size += len(chunk)
                        if size > limit:
                            raise InvalidRequestError(f"media at {url} is over {limit} bytes (max_upload_bytes)")
                        if time.monotonic() > deadline:
                            raise MediaFetchError(f"fetching {url} took over {policy.timeout_s:g} s")
                        chunks.append(chunk)
                    return b"".join(chunks), resp.headers.get("content-type")
        except httpx.TimeoutException:
            raise MediaFetchError(f"fetching {url} took over {policy.timeout_s:g} s") from None
        except httpx.HTTPError as exc:
            raise MediaFetchError(f"fetching {url} failed: {type(exc).__name__}: {exc}") from None
    raise MediaFetchError(f"fetching {url}: more than {policy.max_redirects} redirects")
