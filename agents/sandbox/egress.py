"""Egress policy for jobs with network: what a job may reach from the node, enforced with iptables.

A job never reaches the node's own services (the agent, a portal or database
or broker on the node, whatever listens on loopback or on any of the node's
addresses), private, link-local (cloud metadata at 169.254.169.254), shared,
multicast and reserved ranges, in IPv4 and IPv6; everything else (the public
internet) it may reach. The operator opens exceptions with
``--egress-allow`` (CIDRs or host names, resolved when the agent starts),
e.g. a package mirror on the LAN. DNS to the node's own resolvers
(``/etc/resolv.conf``) stays open on port 53: QEMU's user-mode network
forwards the guest's lookups there.

One chain per sandbox driver, in both ``iptables`` and ``ip6tables``,
rebuilt at every agent start, jumped to from the hooks the driver names:

- kvm: ``OUTPUT -m owner --uid-owner FIRST-LAST``. Each VM's QEMU runs
  under its own uid from the agent's range, and QEMU's user-mode network
  (slirp) opens ordinary host sockets for the guest: the guest's
  ``10.0.2.2`` becomes the node's ``127.0.0.1``, so without this chain a job
  reaches every service on the node's loopback;
- docker: ``INPUT`` and ``FORWARD`` (``DOCKER-USER`` when the engine
  manages iptables) for traffic in from the job network's bridge.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import subprocess
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

# Never reachable unless allowed: this host, private and shared ranges, link-local (metadata endpoints),
# documentation, benchmarking, multicast and reserved space.
BLOCKED = {
    4: ("0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
        "192.0.0.0/24", "192.0.2.0/24", "192.168.0.0/16", "198.18.0.0/15", "198.51.100.0/24",
        "203.0.113.0/24", "224.0.0.0/4", "240.0.0.0/4"),
    6: ("::/128", "::1/128", "::ffff:0:0/96", "64:ff9b::/96", "100::/64", "2001:db8::/32", "fc00::/7",
        "fe80::/10", "fec0::/10", "ff00::/8"),
}
TOOLS = {4: "iptables", 6: "ip6tables"}


class EgressError(Exception):
    """The policy is malformed, or the node cannot enforce it; the message names which."""


def parse_allow(raw: str | list[str] | None) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """``--egress-allow``: CIDRs, addresses or host names, comma-separated; names resolve now."""
    items = raw if isinstance(raw, list) else (raw or "").split(",")
    out = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        try:
            out.append(ipaddress.ip_network(item, strict=False))
            continue
        except ValueError:
            pass
        try:
            infos = socket.getaddrinfo(item, None, proto=socket.IPPROTO_TCP)
        except (socket.gaierror, UnicodeError) as exc:
            raise EgressError(f"--egress-allow: {item!r} is neither a CIDR nor a host name that resolves "
                              f"({exc})") from None
        out.extend(sorted({ipaddress.ip_network(info[4][0]) for info in infos}, key=str))
    return out


def node_resolvers(path: str = "/etc/resolv.conf") -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[0] == "nameserver":
                    try:
                        out.append(ipaddress.ip_address(parts[1].split("%")[0]))
                    except ValueError:
                        pass
    except OSError:
        pass
    return out


@dataclass
class Firewall:
    """One chain (``chain``) of the policy and the rules that jump to it (``hooks``: parent chain and
    match arguments; ``"A|B"`` is A where that chain exists, else B). ``install`` is idempotent and
    replaces what an earlier run left."""

    chain: str
    hooks: list[tuple[str, list[str]]]
    allow: list = field(default_factory=list)
    resolvers: list = field(default_factory=node_resolvers)

    def rules(self, family: int) -> list[list[str]]:
        rules = [["-d", str(n), "-j", "RETURN"] for n in self.allow if n.version == family]
        for r in self.resolvers:
            if r.version == family:
                rules += [["-p", proto, "-d", str(r), "--dport", "53", "-j", "RETURN"] for proto in ("udp", "tcp")]
        # Every address of this host, whatever its range (a public IP reaches the node's services too).
        rules.append(["-m", "addrtype", "--dst-type", "LOCAL", "-j", "REJECT"])
        rules += [["-d", n, "-j", "REJECT"] for n in BLOCKED[family]]
        return rules

    def install(self) -> None:
        for family, tool in TOOLS.items():
            if _run(tool, "-n", "-L", self.chain, check=False).returncode != 0:
                _run(tool, "-N", self.chain)
            _run(tool, "-F", self.chain)
            for rule in self.rules(family):
                _run(tool, "-A", self.chain, *rule)
            for parent, match in self._hooks(tool):
                if _run(tool, "-C", parent, *match, "-j", self.chain, check=False).returncode != 0:
                    _run(tool, "-I", parent, "1", *match, "-j", self.chain)
        log.info("egress policy %s installed: %s blocked, allowed: %s", self.chain,
                 "the node's own addresses and private/link-local ranges",
                 ", ".join(map(str, self.allow)) or "nothing extra")

    def remove(self) -> None:
        """Undo ``install`` as far as it went (nothing to undo without iptables)."""
        for tool in TOOLS.values():
            try:
                for parent, match in self._hooks(tool):
                    while _run(tool, "-D", parent, *match, "-j", self.chain, check=False).returncode == 0:
                        pass
                _run(tool, "-F", self.chain, check=False)
                _run(tool, "-X", self.chain, check=False)
            except EgressError:
                continue

    def installed(self) -> bool:
        """Whether both families still hold the chain and every hook (an operator's flush removes them)."""
        for tool in TOOLS.values():
            for parent, match in self._hooks(tool):
                if _run(tool, "-C", parent, *match, "-j", self.chain, check=False).returncode != 0:
                    return False
        return True

    def _hooks(self, tool: str) -> list[tuple[str, list[str]]]:
        out = []
        for parent, match in self.hooks:
            *preferred, last = parent.split("|")
            out.append((next((p for p in preferred if chain_exists(tool, p)), last), match))
        return out


def chain_exists(tool: str, chain: str) -> bool:
    return _run(tool, "-n", "-L", chain, check=False).returncode == 0


def _run(tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        # -w: wait for the xtables lock that another agent or dockerd may hold.
        r = subprocess.run([tool, "-w", "10", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EgressError(f"{tool} cannot run: {exc}") from None
    if check and r.returncode != 0:
        raise EgressError(f"{tool} {' '.join(args)}: {r.stderr.strip() or f'exit {r.returncode}'}")
    return r
