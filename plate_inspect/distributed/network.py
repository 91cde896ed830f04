"""Which network interface gloo listens on, on a node whose host name resolves to a loopback address.

gloo (without ``GLOO_SOCKET_IFNAME``) listens on the first address this host's name resolves to. Many Linux hosts
map their own name to 127.0.0.1 or 127.0.1.1 in /etc/hosts (Debian's and Ubuntu's default, most containers), so
every rank would advertise a loopback address to the others and a job across machines fails to connect
(``Gloo connectFullMesh failed ... Connection refused, remote=[127.0.0.1]``); so does a host whose name resolves
to an address it cannot bind (gloo then falls back to 127.0.0.1). On such a host the interface that
reaches the job's store (``MASTER_ADDR``, which every node reaches) is the one the other nodes can reach too
(:func:`gloo_interface`). Also the one line for a gloo mesh that could not connect (:func:`gloo_line`), and why
the job's store cannot be reached at all (:func:`unreachable`, for the note of a rank waiting to join)."""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import re
import socket
import struct

#: Linux's ioctl that reads an interface's IPv4 address.
_SIOCGIFADDR = 0x8915


def is_loopback(address: str) -> bool:
    """Whether ``address`` (an IP address) is a loopback one; a name or garbage is not."""
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def gloo_default_is_loopback(host: str) -> bool:
    """Whether gloo's default device would listen on loopback: of the addresses ``host`` (this machine's name)
    resolves to, gloo takes the first it can bind, and falls back to 127.0.0.1 when it can bind none (a name that
    does not resolve, or resolves to another machine's or another network namespace's address)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return True
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.bind((address[0], 0, *address[2:]))
        except OSError:
            continue
        return is_loopback(str(address[0]))
    return True


def route_source(address: str, port: int) -> str | None:
    """This host's IPv4 address on the route to ``address`` (no packet is sent), or None (no route, not IPv4)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((address, port))
            return str(s.getsockname()[0])
    except (OSError, UnicodeError, OverflowError):
        return None


def interfaces() -> dict[str, str]:
    """This host's network interfaces that hold an IPv4 address: name -> address (Linux; empty elsewhere)."""
    found: dict[str, str] = {}
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            with contextlib.suppress(OSError):
                found[name] = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)[20:24])
    return found


#: An address that is nowhere (TEST-NET-2, RFC 5737): the route to it is this host's default route.
_ELSEWHERE = "198.51.100.1"


def gloo_interface(environ: dict[str, str] | os._Environ[str], host: str, nodes: int = 1) -> str | None:
    """The interface gloo must listen on for a job of ``nodes`` nodes whose store is at ``MASTER_ADDR``, when its
    default would not do: the interface on the route to the store; on the store's own node, where MASTER_ADDR
    may resolve to loopback too (its name mapped to 127.0.1.1 like the host's), in a job of several nodes, this
    host's only interface that is not loopback, or among several the default route's. None when
    ``GLOO_SOCKET_IFNAME`` is set (the user's choice), this host's name (``host``) resolves to an address other
    nodes can reach, the store is on loopback in a job of one node, or nothing fits."""
    master = environ.get("MASTER_ADDR", "")
    if "GLOO_SOCKET_IFNAME" in environ or not master or not gloo_default_is_loopback(host):
        return None
    try:
        port = int(environ.get("MASTER_PORT", "29500"))
    except ValueError:
        port = 29500
    source = None if is_loopback(master) else route_source(master, port)
    outward = {name: address for name, address in interfaces().items() if not is_loopback(address)}
    if source is not None and not is_loopback(source):
        return next((name for name, address in outward.items() if address == source), None)
    if nodes <= 1 or not outward:
        return None
    if len(outward) == 1:
        return next(iter(outward))
    default = route_source(_ELSEWHERE, port)
    return next((name for name, address in outward.items() if address == default), None)


def unreachable(host: str, port: int, timeout: float) -> str | None:
    """Why ``host:port`` (the job's store) cannot be reached from here: its name does not resolve, no route, or no
    answer within ``timeout`` seconds; None when it answers, or refuses (a host that is up, its store not yet)."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except ConnectionRefusedError:
        return None
    except socket.gaierror as e:
        return f"the name does not resolve here: {e.strerror}"
    except TimeoutError:
        return f"no answer from it in {timeout:.0f} s"
    except (OSError, UnicodeError, OverflowError) as e:
        return str(getattr(e, "strerror", None) or e)
    return None


def gloo_line(error: BaseException) -> str:
    """The one line for a rank whose gloo mesh could not connect to another rank: gloo's reason (with the address
    the other rank listens on), without its source path, and what the nodes must allow."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    reason = re.sub(r"\$\d+$", "", re.sub(r"^.*?\[[^\]]*\.cc:\d+\]\s*", "", text)).strip()
    return (
        f"cannot connect to the job's other ranks over gloo ({reason}): every node must reach the others on any TCP "
        "port at the address gloo listens on there (a host name that resolves to loopback there, or "
        "GLOO_SOCKET_IFNAME=lo, makes it unreachable); set GLOO_SOCKET_IFNAME on every node to the network interface "
        "the nodes share"
    )
