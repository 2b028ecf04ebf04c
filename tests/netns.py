"""Several "machines" on one host for the fleet tests: network namespaces of the test's own, each joined to a bridge
in a hub namespace by a veth pair whose two ends are rate-limited with ``tc`` (tbf), so every byte a machine sends or
receives crosses a link of known capacity. Addresses live only inside these namespaces (10.213.0.0/24 in the hub's
bridge), never on the host's own network; everything is deleted on leaving.

Processes run on a machine through ``ip netns exec``; a thread of this process enters one with :meth:`Network.inside`
(``setns`` moves the calling thread only), so servers of the test's own (an HTTP origin) can listen on a machine and
loaders can run on the node they load for.

Example:
    >>> with Network() as network:  # doctest: +SKIP
    ...     node = network.machine("node0", mbit=1000)
    ...     subprocess.run(node.command(["ip", "addr"]), check=True)
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator, Sequence

from typing_extensions import Self

CLONE_NEWNET = 0x40000000
SUBNET = "10.213.0"
HUB_ADDRESS = f"{SUBNET}.1"


def available() -> str | None:
    """Why namespaces cannot be made here (not root, no ``ip`` or ``tc``), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    return f"no {' or '.join(missing)} (iproute2)" if missing else None


def _run(*command: str) -> str:
    result = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {result.stderr.strip()}")
    return result.stdout


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))


@dataclasses.dataclass(frozen=True)
class Machine:
    """One namespace: its name, its address on the bridge and the hub's end of its link."""

    namespace: str
    address: str
    link: str
    """The interface in the hub that carries everything this machine receives."""

    def command(self, command: Sequence[str], **environment: str) -> list[str]:
        """``command`` run on this machine, with ``environment`` added."""
        pairs = [f"{name}={value}" for name, value in environment.items()]
        return ["ip", "netns", "exec", self.namespace, "env", *pairs, *command]


class Network:
    """A hub namespace with a bridge (``with Network() as network:``); :meth:`machine` adds a machine on it."""

    def __init__(self) -> None:
        self.token = secrets.token_hex(3)
        self.hub = f"ws{self.token}hub"
        self.machines: list[Machine] = []

    def __enter__(self) -> Self:
        _run("ip", "netns", "add", self.hub)
        try:
            _run("ip", "-n", self.hub, "link", "set", "lo", "up")
            _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.hub, "addr", "add", f"{HUB_ADDRESS}/24", "dev", "br0")
            _run("ip", "-n", self.hub, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def machine(self, name: str, mbit: float | None = None) -> Machine:
        """A new machine (namespace) on the bridge, its link limited to ``mbit`` Mbit/s each way (None: no limit)."""
        number = len(self.machines) + 2
        namespace, link = f"ws{self.token}{name}", f"link{number}"
        _run("ip", "netns", "add", namespace)
        machine = Machine(namespace, f"{SUBNET}.{number}", link)
        self.machines.append(machine)
        _run("ip", "link", "add", "eth0", "netns", namespace, "type", "veth", "peer", "name", link, "netns", self.hub)
        _run("ip", "-n", self.hub, "link", "set", link, "master", "br0", "up")
        _run("ip", "-n", namespace, "addr", "add", f"{machine.address}/24", "dev", "eth0")
        _run("ip", "-n", namespace, "link", "set", "eth0", "up")
        _run("ip", "-n", namespace, "link", "set", "lo", "up")
        if mbit is not None:
            for where, device in ((namespace, "eth0"), (self.hub, link)):
                self._limit(where, device, mbit)
        return machine

    @staticmethod
    def _limit(namespace: str, device: str, mbit: float) -> None:
        burst = max(64 << 10, int(mbit * 1e6 / 8 / 100))  # 10 ms of the rate
        rate = f"{int(mbit * 1000)}kbit"
        _run("tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf", "rate", rate, "burst", str(burst),
             "latency", "100ms")  # fmt: skip

    def received_bytes(self, machine: Machine) -> int:
        """Bytes the hub has sent down ``machine``'s link (all it received over the network)."""
        (link,) = json.loads(_run("ip", "-n", self.hub, "-s", "-j", "link", "show", "dev", machine.link))
        return int(link["stats64"]["tx"]["bytes"])

    @contextlib.contextmanager
    def inside(self, machine: Machine | None = None) -> Iterator[None]:
        """The calling thread in ``machine``'s namespace (the hub's for None) until the block ends: sockets it opens
        there stay there."""
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/run/netns/{machine.namespace if machine else self.hub}", os.O_RDONLY)
        try:
            _setns(target)
            try:
                yield
            finally:
                _setns(home)
        finally:
            os.close(target)
            os.close(home)

    def namespaces(self) -> list[str]:
        """This network's namespaces that still exist."""
        listed = _run("ip", "netns", "list").split()
        return [name for name in listed if name.startswith(f"ws{self.token}")]

    def close(self) -> None:
        """Delete every machine's namespace and the hub (their links go with them)."""
        for namespace in [machine.namespace for machine in self.machines] + [self.hub]:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30, check=False)
        self.machines.clear()
