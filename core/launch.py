"""What run.sh checks before it starts torchrun (NPROC_PER_NODE or NNODES above 1): a launch
that would fail inside torchrun (its usage text, a C++ traceback, a rendezvous that never
answers) is one line and exit 2 here instead, before any process starts:

- one GPU per process: NPROC_PER_NODE at most the node's GPUs, unless device=cpu;
- NODE_RANK below NNODES; MASTER_PORT and RDZV_ENDPOINT's port in 1..65535; RDZV_TIMEOUT
  a whole number of seconds;
- the hosts named (MASTER_ADDR, RDZV_ENDPOINT's) resolve;
- a node that does not host the rendezvous (RDZV_ENDPOINT on another machine, or NODE_RANK
  above 0 with a fixed master) waits up to RDZV_TIMEOUT seconds for the host to answer,
  then gives up. run.sh hands torchrun the same timeout for every node to join.

    RDZV_TIMEOUT=300 python -m resmlp.core.launch <the command's arguments>
"""
from __future__ import annotations

import os
import socket
import sys
import time

C10D_PORT = 29400   # torchrun's port when RDZV_ENDPOINT names none
MASTER_PORT = 29500  # run.sh's MASTER_PORT when unset


def whole(env: dict, name: str, default: str, low: int, high: int | None = None) -> int:
    text = env.get(name) or default
    if not text.isdigit() or int(text) < low or (high is not None and int(text) > high):
        bound = f"in {low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"{name}={text!r} must be a whole number {bound}")
    return int(text)


def port(text: str, what: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError(f"{what} is not a port (a whole number in 1..65535)")
    return int(text)


def endpoint(text: str) -> tuple[str, int]:
    """RDZV_ENDPOINT as torchrun reads it: host, host:port or [IPv6]:port."""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        return host, port(rest[1:], f"the port of RDZV_ENDPOINT={text!r}") if rest.startswith(":") else C10D_PORT
    host, sep, p = text.rpartition(":")
    if not sep:
        return text, C10D_PORT
    return host, port(p, f"the port of RDZV_ENDPOINT={text!r}")


def addresses(host: str, name: str) -> list[str]:
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)})
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"{name}: host {host!r} cannot be resolved ({getattr(e, 'strerror', None) or e}); "
                         "name a machine every node reaches") from None


def is_this_machine(ips: list[str]) -> bool:
    """Whether one of the addresses is this machine's: only those can be bound to."""
    for ip in ips:
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((ip, 0))
            return True
        except OSError:
            continue
    return False


def wait_for(host: str, p: int, timeout: float, say=print) -> bool:
    """True once something accepts a connection at host:p, False after `timeout` seconds."""
    deadline, told = time.monotonic() + timeout, False
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, p), timeout=max(0.1, min(5.0, left))):
                return True
        except OSError:
            if left <= 0:
                return False
            if not told:
                say(f"run.sh: nothing answers at {host}:{p} yet; waiting up to {timeout:g} s (RDZV_TIMEOUT) for "
                    "the node that hosts the rendezvous", flush=True)
                told = True
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def gpu_problem(nproc: int, args: list[str]) -> str | None:
    """One GPU per process: more processes than GPUs would fail deep inside torchrun."""
    import torch
    have = torch.cuda.device_count()
    if have and "device=cpu" not in args and nproc > have:
        return (f"NPROC_PER_NODE={nproc} but this node has {have} GPU(s): start at most {have} processes per "
                "node (one GPU each), or pass device=cpu")
    return None


def problem(env: dict, args: list[str]) -> str | None:
    """What is wrong with the launch run.sh is about to make, or None."""
    try:
        nproc, nnodes = whole(env, "NPROC_PER_NODE", "1", 1), whole(env, "NNODES", "1", 1)
        node_rank = whole(env, "NODE_RANK", "0", 0, nnodes - 1)
        timeout = whole(env, "RDZV_TIMEOUT", "", 1)  # run.sh sets its default
        if env.get("RDZV_ENDPOINT"):
            host, p = endpoint(env["RDZV_ENDPOINT"])
            where, name, hosts_it = f"RDZV_ENDPOINT={env['RDZV_ENDPOINT']}", "RDZV_ENDPOINT", None
        else:
            given = env.get("MASTER_PORT") or str(MASTER_PORT)
            host, p = env.get("MASTER_ADDR") or "127.0.0.1", port(given, f"MASTER_PORT={given!r}")
            where, name, hosts_it = f"MASTER_ADDR={host} MASTER_PORT={p}", "MASTER_ADDR", node_rank == 0
        ips = addresses(host, name)
    except ValueError as e:
        return str(e)
    gpus = gpu_problem(nproc, args)
    if gpus:
        return gpus
    if hosts_it is None:
        hosts_it = is_this_machine(ips)
    if not hosts_it and not wait_for(host, p, timeout):
        return (f"nothing answered at {where} within {timeout} s (RDZV_TIMEOUT): start the same command on the "
                f"node that hosts it{' (NODE_RANK=0)' if name == 'MASTER_ADDR' else ''}, or fix the address")
    return None


if __name__ == "__main__":
    found = problem(dict(os.environ), sys.argv[1:])
    if found:
        print(f"run.sh: {found}", file=sys.stderr)
        sys.exit(2)
