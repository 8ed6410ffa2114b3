"""The job's side of order hints (the daemon's is cachefs.hints): one session on a mount's
control socket, telling it the files of the coming samples. Imported by
`cachefs.torch.HintedSampler`; it imports nothing of the daemon.
"""

from __future__ import annotations

import json
import logging
import socket

log = logging.getLogger(__name__)

# Default samples a HintedSampler tells ahead of what it has handed out.
DEFAULT_LOOKAHEAD = 2048

# Paths per message from the client.
CHUNK = 64


class HintClient:
    """One session, from the job's side. Every failure (no cachefs at the path, an old
    daemon, the mount gone, a daemon too slow to take the hints) turns hinting off for the
    rest of the session with one warning: a hint is never worth stopping the job."""

    def __init__(self, address: str, lookahead: int = DEFAULT_LOOKAHEAD, label: str = "",
                 timeout: float = 2.0):
        self.session: int | None = None
        self.budget = 0
        self._sock: socket.socket | None = None
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            sock.connect(address)
            sock.sendall(json.dumps({"op": "hint", "lookahead": lookahead, "label": label}).encode() + b"\n")
            reply = json.loads(sock.makefile("rb").readline() or b"{}")
            if "session" not in reply:
                sock.close()
                raise OSError(reply.get("error", "no answer"))
            self.session, self.budget = int(reply["session"]), int(reply.get("budget_bytes", 0))
            self._sock = sock
        except (OSError, ValueError) as exc:
            log.warning("cachefs: order hints off: %s", exc)

    @property
    def active(self) -> bool:
        return self._sock is not None

    def send(self, paths: list[str], yielded: int) -> bool:
        if self._sock is None:
            return False
        try:
            self._sock.sendall(json.dumps({"paths": paths, "yielded": yielded}).encode() + b"\n")
            return True
        except OSError as exc:
            log.warning("cachefs: order hints off: %s", exc)
            self.close()
            return False

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None
