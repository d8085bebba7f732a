# Session-pinned routing over the replicas of one stage (thinker, talker or code2wav), Triton-agnostic.
#
# A stage request is part of a session (talker: start, then appends, then maybe an abort; thinker: the
# stream, then maybe an abort; code2wav: a stream's chunks, then maybe an abort), and a stage replica keeps
# the session's state (KV slot, pending rows, Code2Wav's carried state).
# A BLS call cannot choose an instance of a model, so each replica is its own model, and every call of
# a session must reach the replica that holds it. New sessions go to the replica with the fewest sessions
# pinned; ties rotate, so that a trickle of one request at a time is spread too.
from __future__ import annotations

import threading


class ReplicaRouter:
    def __init__(self, replicas: list[str]):
        if not replicas or len(set(replicas)) != len(replicas):
            raise ValueError(f"replicas must be distinct names, got {replicas!r}")
        self.replicas = list(replicas)
        self._sessions: dict[str, str] = {}  # session -> replica
        self._load = dict.fromkeys(self.replicas, 0)  # replica -> sessions pinned
        self._next = 0  # where the tie-break starts
        self._lock = threading.Lock()  # several request threads of omni_ensemble route at once

    def pin(self, session: str) -> str:
        """The session's replica, chosen now by load if it has none yet."""
        with self._lock:
            replica = self._sessions.get(session)
            if replica is None:
                order = self.replicas[self._next :] + self.replicas[: self._next]
                replica = min(order, key=self._load.__getitem__)
                self._next = (self.replicas.index(replica) + 1) % len(self.replicas)
                self._sessions[session] = replica
                self._load[replica] += 1
            return replica

    def get(self, session: str) -> str | None:
        with self._lock:
            return self._sessions.get(session)

    def release(self, session: str) -> None:
        with self._lock:
            replica = self._sessions.pop(session, None)
            if replica is not None:
                self._load[replica] -= 1

    def load(self) -> dict[str, int]:
        with self._lock:
            return dict(self._load)
