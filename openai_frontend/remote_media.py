# Fetching of http(s) media URLs (only when the operator enabled it). A client must not reach through the
# server what only the server can reach: every hop's host is resolved here, every address it resolves to must
# be public (not loopback, private, link-local, shared, reserved or a cloud metadata address) or inside a
# network the operator allowed, and the connection goes to the address that was checked (so a second DNS
# answer cannot swap it). Redirects are followed by hand, each target checked the same way. Errors name the
# part and the URL, never what the target answered (its status or body).
from __future__ import annotations

import asyncio
import ipaddress
import socket
from urllib.parse import urljoin

import httpx

from openai_frontend.errors import FrontendError

MAX_REDIRECTS = 3
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(cidrs: tuple[str, ...] | list[str]) -> tuple[Network, ...]:
    return tuple(ipaddress.ip_network(c.strip(), strict=False) for c in cidrs if c.strip())


def is_public(address: Address, allowed: tuple[Network, ...] = ()) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    if any(address in net for net in allowed):
        return True
    # is_global is False for loopback, RFC 1918, link-local (169.254.169.254), shared 100.64/10 (100.100.100.200),
    # ULA (fd00:ec2::254), unspecified, documentation and reserved ranges
    return address.is_global and not address.is_multicast


async def fetch(client: httpx.AsyncClient, url: str, where: str, *, max_bytes: int, timeout_s: float,
                allowed: tuple[Network, ...] = ()) -> tuple[str, bytes]:  # fmt: skip
    """(content type, body) of `url`; a FrontendError (400) naming `where` for anything but a 200 from a public
    address within `timeout_s` (the whole download, redirects included) and `max_bytes`."""
    try:
        async with asyncio.timeout(timeout_s):
            for _ in range(MAX_REDIRECTS + 1):
                target, host = await _checked_target(url, where, allowed)
                request = client.build_request("GET", target, headers={"Host": host},
                                               extensions={"sni_hostname": host.split(":")[0].strip("[]")})  # fmt: skip
                response = await client.send(request, stream=True)
                try:
                    if response.is_redirect and "location" in response.headers:
                        url = urljoin(url, response.headers["location"])
                        continue
                    if response.status_code != 200:
                        raise _bad(where, f"{url} did not return a media file")
                    return _mime(response), await _read(response, where, url, max_bytes)
                finally:
                    await response.aclose()
            raise _bad(where, f"{url} redirects more than {MAX_REDIRECTS} times")
    except TimeoutError:
        raise _bad(where, f"fetching {url} took longer than {timeout_s:g} s") from None
    except httpx.HTTPError:
        raise _bad(where, f"cannot fetch {url}") from None


async def _checked_target(url: str, where: str, allowed: tuple[Network, ...]) -> tuple[httpx.URL, str]:
    """The URL rewritten to a checked address of its host, and the Host header."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError):
        raise _bad(where, "not a valid URL") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise _bad(where, f"{url}: only http(s) URLs with a host can be fetched")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(parsed.host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise _bad(where, f"{url}: cannot resolve its host") from None
    addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    # every address, not only the first: a name with one public and one private address is refused
    if not addresses or not all(is_public(a, allowed) for a in addresses):
        raise FrontendError(400, f"{where}: {url} resolves to an address this server does not fetch from",
                            param=where, code="remote_media_forbidden")  # fmt: skip
    host = parsed.netloc.decode("ascii").rsplit("@", 1)[-1]
    return parsed.copy_with(host=str(addresses[0])), host


async def _read(response: httpx.Response, where: str, url: str, max_bytes: int) -> bytes:
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _bad(where, f"{url} is larger than {max_bytes} bytes")
    body = bytearray()
    async for block in response.aiter_bytes():
        body += block
        if len(body) > max_bytes:
            raise _bad(where, f"{url} is larger than {max_bytes} bytes")
    return bytes(body)


def _mime(response: httpx.Response) -> str:
    return response.headers.get("content-type", "").split(";")[0].strip().lower()


def _bad(where: str, message: str) -> FrontendError:
    return FrontendError(400, f"{where}: {message}", param=where, code="remote_media_failed")


def client(timeout_s: float) -> httpx.AsyncClient:
    # redirects by hand (fetch), environment proxies ignored: a proxy would connect where it likes
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), follow_redirects=False, trust_env=False)
