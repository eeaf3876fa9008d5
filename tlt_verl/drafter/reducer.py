"""The collectives DrafterTrainer needs, over whichever set of ranks is training together.

Three implementations:
- ``LocalReducer``: one process; every collective is the identity.
- ``TorchDistReducer``: a torch.distributed group (the default one unless told otherwise).
- ``SpotSession``: a group of *some* ranks, formed from a rendezvous of its own. TLT trains
  the drafter on the ranks whose rollout replica is idle, and that set changes during a rollout;
  ``torch.distributed.new_group`` needs every rank of the world to call it, which the busy ranks
  cannot, so a session builds its process group (Gloo for a drafter on the CPU, NCCL for one on a
  GPU) directly on a TCPStore hosted by its rank 0.
  Members first check in on that store; until all have, any of them may call the session off for
  all (a replica that got work again, a rollout that ended), so no member waits on a group that
  will never complete.

Every collective works in place and returns its tensor, on the device the drafter lives on.
"""
from __future__ import annotations

import datetime
import socket
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist


@runtime_checkable
class Reducer(Protocol):
    @property
    def size(self) -> int: ...

    @property
    def rank(self) -> int: ...

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def all_reduce_max_(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def broadcast_(self, tensor: torch.Tensor, src: int) -> torch.Tensor: ...


class LocalReducer:
    size = 1
    rank = 0

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_reduce_max_(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def broadcast_(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        if src != 0:
            raise ValueError(f"LocalReducer.broadcast_: src={src}: the only rank is 0")
        return tensor


class TorchDistReducer:
    """A torch.distributed process group (``None``: the default group, which must be initialised)."""

    def __init__(self, group=None):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("TorchDistReducer: torch.distributed is not initialised")
        self.group = group

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def all_reduce_max_(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return tensor

    def broadcast_(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        # torch.distributed.broadcast takes a global rank; src here is the rank inside the group.
        root = src if self.group is None else dist.get_global_rank(self.group, src)
        dist.broadcast(tensor, src=root, group=self.group)
        return tensor


def default_reducer() -> LocalReducer | TorchDistReducer:
    """What a trainer without an explicit reducer uses: the default torch.distributed group when
    one is initialised with more than one rank, else this process alone."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchDistReducer()
    return LocalReducer()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (another process may still take it before the
    session's rank 0 binds it: callers retry with a new port on a bind error)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class SessionAborted(RuntimeError):
    """A member gave up on the session before all members had joined; none of them trains in it."""


GO, ABORT = b"go", b"abort"


def _connect(host: str, port: int, size: int, is_master: bool, deadline: float,
             abort: Callable[[], bool], poll_s: float) -> dist.TCPStore:
    """The session's store. A non-master first waits, quietly and abortably, for rank 0 to listen
    (TCPStore's own connect retries cannot be interrupted and log every failed attempt)."""
    while not is_master:
        try:
            with socket.create_connection((host, port), timeout=min(1.0, max(deadline - time.monotonic(), 0.01))):
                break
        except OSError:
            if abort():
                raise SessionAborted(f"gave up waiting for the session store at {host}:{port}") from None
            if time.monotonic() >= deadline:
                raise SessionAborted(f"no session store at {host}:{port} within the timeout") from None
            time.sleep(poll_s)
    left = max(deadline - time.monotonic(), 0.01)
    return dist.TCPStore(host, port, size, is_master, wait_for_workers=False, timeout=datetime.timedelta(seconds=left))


def _decide(store, size: int, deadline: float, abort: Callable[[], bool], poll_s: float) -> bytes:
    """Agree on ``go`` (every member has checked in) or ``abort`` (one gave up first), through one
    compare-and-set key: whichever is written first holds for every member, also for one that
    checks in late."""
    store.add("joined", 1)
    while True:
        if store.check(["decision"]):
            return store.get("decision")
        if store.add("joined", 0) >= size:
            return store.compare_set("decision", "", GO)
        if abort():
            return store.compare_set("decision", "", ABORT)
        if time.monotonic() >= deadline:
            return store.compare_set("decision", "", ABORT)
        time.sleep(poll_s)


def _nccl_group(store, rank: int, size: int, timeout: datetime.timedelta):
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, opts)


# A session's process group by backend; the drafter's device picks it (BACKEND_OF_DEVICE).
PROCESS_GROUPS = {"gloo": dist.ProcessGroupGloo, "nccl": _nccl_group}
BACKEND_OF_DEVICE = {"cpu": "gloo", "cuda": "nccl"}


class SpotSession:
    """A group of ``size`` ranks that meet at ``host:port``; rank 0 hosts the store there.

    ``session_id`` prefixes every store key, so a store that outlives a session (or a port reused
    by a later one) never hands one session's rendezvous keys to another."""

    # The store of the last session this process (as rank 0) aborted: kept up so that members
    # checking in late read the abort instead of waiting for a store that is gone.
    _aborted_store = None

    def __init__(self, store, pg, rank: int, size: int, session_id: str, backend: str = "gloo"):
        self._store = store
        self._pg = pg
        self.backend = backend
        self._rank = rank
        self._size = size
        self.session_id = session_id

    @classmethod
    def join(cls, host: str, port: int, session_id: str, rank: int, size: int, timeout_s: float = 300.0,
             abort: Callable[[], bool] | None = None, poll_s: float = 0.01, backend: str = "gloo") -> "SpotSession":
        """Blocks until all ``size`` members have joined. ``abort()`` returning True while some
        are still missing gives up for all of them (``SessionAborted``); once all have joined the
        session goes ahead regardless. ``timeout_s`` bounds the wait (``SessionAborted`` too) and
        every later collective, so a member that dies mid-session makes the others fail instead
        of hang."""
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"SpotSession.join: rank={rank}, size={size}: need 0 <= rank < size")
        if not session_id:
            raise ValueError("SpotSession.join: session_id must be non-empty")
        if backend not in PROCESS_GROUPS:
            raise ValueError(f"SpotSession.join: backend={backend!r}: one of {', '.join(PROCESS_GROUPS)}")
        abort = abort or (lambda: False)
        cls._aborted_store = None       # whoever was late for that one is later still: release the port
        deadline = time.monotonic() + timeout_s
        store = _connect(host, port, size, rank == 0, deadline, abort, max(poll_s, 0.05))
        prefix = f"tlt-drafter/{session_id}"
        decision = _decide(dist.PrefixStore(f"{prefix}/rdzv", store), size, deadline, abort, poll_s)
        if decision != GO:
            if rank == 0:
                cls._aborted_store = store
            late = time.monotonic() >= deadline
            raise SessionAborted(f"session {session_id}: " + (f"not all {size} members joined within {timeout_s}s"
                                                              if late else "a member gave up before all had joined"))
        # Everyone has checked in, so this rendezvous completes at once.
        pg = PROCESS_GROUPS[backend](dist.PrefixStore(f"{prefix}/pg", store), rank, size,
                                     datetime.timedelta(seconds=timeout_s))
        return cls(store, pg, rank, size, session_id, backend)

    @property
    def size(self) -> int:
        return self._size

    @property
    def rank(self) -> int:
        return self._rank

    def _run(self, tensor: torch.Tensor, op) -> torch.Tensor:
        if self._pg is None:
            raise RuntimeError(f"SpotSession {self.session_id}: closed")
        # Gloo reduces host tensors, NCCL device ones: a tensor elsewhere makes a round trip.
        device = "cpu" if self.backend == "gloo" else "cuda"
        work = tensor if tensor.device.type == device and tensor.is_contiguous() else tensor.detach().to(device).contiguous()
        op(work).wait()
        if work is not tensor:
            tensor.copy_(work)
        return tensor

    def _allreduce(self, tensor: torch.Tensor, reduce_op) -> torch.Tensor:
        opts = dist.AllreduceOptions()
        opts.reduceOp = reduce_op
        return self._run(tensor, lambda t: self._pg.allreduce([t], opts))

    def all_reduce_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._allreduce(tensor, dist.ReduceOp.SUM)

    def all_reduce_max_(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._allreduce(tensor, dist.ReduceOp.MAX)

    def broadcast_(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        if not 0 <= src < self._size:
            raise ValueError(f"SpotSession.broadcast_: src={src}: not a member of a {self._size}-rank session")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        return self._run(tensor, lambda t: self._pg.broadcast([t], opts))

    def close(self) -> None:
        """Drop the group and, on rank 0, the store. Only call it after the members' last
        collective: the store is needed while any member is still joining."""
        pg, self._pg = self._pg, None
        if pg is not None:
            pg.shutdown()
        self._store = None

    def __enter__(self) -> "SpotSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
