#!/usr/bin/env python3
"""servebench: a serving process's loop alone, its CPU per request, side by side.

    python tools/servebench.py [--opens 50000] [--lookups] [--repeats 3] [--baseline DIR]

One serving process's loop (cachefs/fuse/serve.py, `Server.run`) answers requests fed to
it through a socket pair (SOCK_SEQPACKET: one request per read, as from /dev/fuse) instead
of the kernel: per open an OPEN, an IOCTL (Python's `isatty()`) and a RELEASE of a node
published in its table, and with --lookups a LOOKUP of the file's published name first.
No mount, no daemon: the figure is the loop's own CPU per request (the thread's user and
system time, the socket's system calls included), steadier than a whole epoch on a shared
machine. With --baseline, the serving loop of another checkout (DIR/src) in the same run,
the two alternating; medians over --repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run in a child interpreter with the checkout's src first on sys.path.
_CHILD = r'''
import errno, json, os, socket, sys, threading, time
from cachefs.fuse import protocol as p
from cachefs.fuse.serve import _OPEN_REPLY, OWN_FH, Server
from cachefs.fuse.servetable import ANSWERED, FORWARDED, ServeTable

opens, with_lookups = int(sys.argv[1]), sys.argv[2] == "1"
FILES = 1000
table = ServeTable.create(1 << 16, 1, names=4 * FILES)
deadline = time.monotonic_ns() + 10**12
entry = {nodeid: nodeid.to_bytes(8, "little") + bytes(120) for nodeid in range(2, 2 + FILES)}
for nodeid in range(2, 2 + FILES):
    table.publish(nodeid, 1000 + nodeid)  # its backing id
    table.publish_name(nodeid, 1, b"n%08d.JPEG" % nodeid, entry[nodeid], deadline)


def request(opcode, unique, nodeid, body):
    return p.IN_HEADER.pack(40 + len(body), opcode, unique, nodeid, 0, 0, 0, 0, 0) + body


# unique -> the reply a serving process gives: the published entry, the passthrough open
# with the node's backing id, ENOTTY, the release
requests, unique, expected = [], 1, {}
for i in range(opens):
    nodeid = 2 + i % FILES
    if with_lookups:
        requests.append(request(p.LOOKUP, unique, 1, b"n%08d.JPEG\0" % nodeid))
        expected[unique] = p.OUT_HEADER.pack(16 + 128, 0, unique) + entry[nodeid]
        unique += 1
    requests.append(request(p.OPEN, unique, nodeid, p.OPEN_IN.pack(os.O_RDONLY, 0)))
    requests.append(request(p.IOCTL, unique + 1, nodeid, bytes(32)))
    requests.append(request(p.RELEASE, unique + 2, nodeid, p.RELEASE_IN.pack(OWN_FH | nodeid, 0, 0, 0)))
    flags = p.FOPEN_PASSTHROUGH | p.FOPEN_NOFLUSH
    expected[unique] = _OPEN_REPLY.pack(32, 0, unique, OWN_FH | nodeid, flags, 1000 + nodeid)
    expected[unique + 1] = p.OUT_HEADER.pack(16, -errno.ENOTTY, unique + 1)
    expected[unique + 2] = p.OUT_HEADER.pack(16, 0, unique + 2)
    unique += 3
kernel, served = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
to_main, main = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
replies = []


def feed():
    """The kernel's side: at most 64 requests waiting, every reply read; a reply that does
    not come within 5 s (a request the loop forwarded) ends the feed, counted missing."""
    sent = 0
    kernel.settimeout(5)
    try:
        while len(replies) < len(requests):
            while sent < len(requests) and sent - len(replies) < 64:
                kernel.send(requests[sent])
                sent += 1
            replies.append(kernel.recv(4096))
    except TimeoutError:  # as if the main process had answered what was forwarded: reading
        table.set_line(0, ANSWERED, table.line(0, FORWARDED))  # goes on, to the end
    kernel.shutdown(socket.SHUT_WR)  # the loop reads the end of the file and returns


def drain():
    """The main process's side: reports read and dropped."""
    while True:
        try:
            main.recv(1 << 16)
        except OSError:
            return


threading.Thread(target=drain, daemon=True).start()
feeder = threading.Thread(target=feed, daemon=True)  # a loop that fails ends the run
server = Server(0, served.fileno(), table, to_main, 1 << 18)
feeder.start()
cpu = time.thread_time()
server.run()
cpu = time.thread_time() - cpu
feeder.join()
# replies missing, and replies not the one their request gets from a serving process
bad = len(requests) - len(replies)
for r in replies:
    u = p.OUT_HEADER.unpack_from(r)[2] if len(r) >= 16 else 0
    bad += expected.pop(u, None) != r
print(json.dumps({"requests": len(requests), "us_per_request": cpu / len(requests) * 1e6, "bad": bad}))
'''


def run(checkout: str, opens: int, lookups: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.join(checkout, "src"))
    out = subprocess.run([sys.executable, "-c", _CHILD, str(opens), "1" if lookups else "0"],
                         capture_output=True, text=True, env=env, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"servebench: the loop of {checkout} failed: {out.stderr.strip().splitlines()[-1:]}")
    result = json.loads(out.stdout)
    if result["bad"]:
        raise SystemExit(f"servebench: {result['bad']} replies of {checkout} were not replies")
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--opens", type=int, default=50_000)
    ap.add_argument("--lookups", action="store_true", help="a LOOKUP of a published name before each open")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline", metavar="DIR", help="also the serving loop of the checkout in DIR")
    args = ap.parse_args(argv)
    systems = [("this checkout", ROOT)] + ([("baseline", args.baseline)] if args.baseline else [])
    figures: dict[str, list[float]] = {label: [] for label, _ in systems}
    for _ in range(args.repeats):
        for label, checkout in systems:
            figures[label].append(run(checkout, args.opens, args.lookups)["us_per_request"])
    kind = "LOOKUP, OPEN, IOCTL, RELEASE" if args.lookups else "OPEN, IOCTL, RELEASE"
    print(f"{args.opens} opens ({kind}), CPU per request of the serving loop, median of {args.repeats}:")
    reference = statistics.median(figures[systems[0][0]])
    for label, values in figures.items():
        median = statistics.median(values)
        each = ", ".join(f"{v:.2f}" for v in values)
        print(f"  {label:14s} {median:.2f} us ({each}); {median / reference:.2f}x this checkout")
    return 0


if __name__ == "__main__":
    sys.exit(main())
