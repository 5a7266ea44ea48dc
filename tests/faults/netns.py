"""A network namespace of its own for each agent of the fault suite, so one node can be cut off
from the portal by dropping its packets (docs/reliability.md F-05), as a switch port or a
firewall would, with the agent and its jobs still running.

Each namespace is joined to the host by a veth pair with a /30 of its own in 10.231.0.0/16 (a
block no other interface of the host uses); the portal (gunicorn) and Redis also listen on the
host end, and the agent reaches them there. Nothing is routed beyond the pair. A partition is two
iptables DROP rules inside the namespace (out to the host end, in from it); healing deletes them.
Needs root, `ip` and `iptables`.
"""
import ipaddress
import os
import shutil
import subprocess
from dataclasses import dataclass

BLOCK = ipaddress.ip_network("10.231.0.0/16")


def available() -> str:
    """"" when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root"
    missing = [t for t in ("ip", "iptables") if not shutil.which(t)]
    return f"needs {', '.join(missing)}" if missing else ""


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


def _used_24s() -> set:
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=30).stdout
    used = set()
    for word in out.split():
        if "/" in word:
            try:
                addr = ipaddress.ip_interface(word).ip
            except ValueError:
                continue
            if addr in BLOCK:
                used.add(ipaddress.ip_network(f"{addr}/24", strict=False))
    return used


@dataclass
class Netns:
    name: str  # the namespace; its veth ends are NAME-h (host) and NAME-n (inside)
    host_addr: str
    ns_addr: str
    cut: bool = False

    def argv(self, argv: list[str]) -> list[str]:
        """`argv` run inside the namespace (the network only: files and processes are the host's)."""
        return ["nsenter", f"--net=/run/netns/{self.name}", "--", *argv]

    def partition(self, on: bool) -> None:
        """Drop (or stop dropping) every packet between the agent and the host end: the portal,
        Redis and everything else it could reach."""
        if on == self.cut:
            return
        op = "-I" if on else "-D"
        for chain, way in (("OUTPUT", "-d"), ("INPUT", "-s")):
            _run("ip", "netns", "exec", self.name, "iptables", op, chain, way, self.host_addr, "-j", "DROP")
        self.cut = on

    def delete(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", f"{self.name}h"], capture_output=True, timeout=30)


def make(count: int) -> list[Netns]:
    """`count` namespaces with a veth pair each, in one /24 of BLOCK no interface uses yet."""
    used = _used_24s()
    seed = os.getpid() % 256
    net = next((n for i in range(256) if (n := list(BLOCK.subnets(new_prefix=24))[(seed + i) % 256]) not in used),
               None)
    if net is None:
        raise RuntimeError(f"no free /24 left in {BLOCK}")
    made = []
    try:
        for i, pair in enumerate(list(net.subnets(new_prefix=30))[:count]):
            host, inside = list(pair.hosts())
            ns = Netns(f"gpf{os.getpid() % 100000}x{i}", str(host), str(inside))
            made.append(ns)
            _run("ip", "netns", "add", ns.name)
            _run("ip", "link", "add", f"{ns.name}h", "type", "veth", "peer", "name", f"{ns.name}n")
            _run("ip", "link", "set", f"{ns.name}n", "netns", ns.name)
            _run("ip", "addr", "add", f"{host}/30", "dev", f"{ns.name}h")
            _run("ip", "link", "set", f"{ns.name}h", "up")
            _run("ip", "netns", "exec", ns.name, "ip", "addr", "add", f"{inside}/30", "dev", f"{ns.name}n")
            _run("ip", "netns", "exec", ns.name, "ip", "link", "set", f"{ns.name}n", "up")
            _run("ip", "netns", "exec", ns.name, "ip", "link", "set", "lo", "up")
    except BaseException:
        for ns in made:
            ns.delete()
        raise
    return made
