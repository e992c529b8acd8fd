"""Byte exchanges between ranks: torch.distributed all_to_all_single, or an in-process loopback world.

The torch provider moves packed uint8 wire rows through one of these. Every exchange is split into
post (at send time) and wait (at receive time), so a loopback world can drive all ranks' sends, then
all ranks' receives, from one thread, and a distributed group overlaps the transfer with compute.

A wait gives up on a peer that never sends after SGLANG_MORI_PEER_TIMEOUT_S: over gloo each peer's
rows come through a receive of their own, waited with the time left, so the error names the peer; over
NCCL / RCCL the host waits for the all_to_all with the timeout (a collective cannot tell which peer
never sent). Inside CUDA graph capture the wait is the stream's, as before.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from mori_sglang.env import DEFAULT_PEER_TIMEOUT_S
from mori_sglang.types import PeerTimeoutError, collective_timeout_error, peer_timeout_error


class ExchangeError(PeerTimeoutError):
    """A loopback receive was asked for before every rank posted its send: one thread drives every
    rank, so the peer will never send and the receive gives up at once."""


class Pending(Protocol):
    def wait(self) -> tuple[torch.Tensor, list[int] | None]: ...


@dataclass
class _PostedExchange:
    """A posted exchange: ``result`` waits for it and returns the received rows and counts."""

    result: Callable[[], tuple[torch.Tensor, list[int] | None]]

    def wait(self) -> tuple[torch.Tensor, list[int] | None]:
        return self.result()


class Exchange(Protocol):
    rank: int
    world_size: int

    def variable(self, rows: torch.Tensor, send_counts: list[int]) -> Pending:
        """Rows grouped by destination; wait() gives received rows grouped by source and their counts."""

    def fixed(self, chunks: torch.Tensor) -> Pending:
        """``[W, ...]``: chunk d goes to rank d; wait() gives ``[W, ...]`` with chunk s from rank s."""


class DistExchange:
    """all_to_all_single over a ProcessGroup (NCCL, RCCL; across nodes), or over gloo a send and a
    receive per peer, each receive waited with what is left of ``timeout_s``.

    The all_to_all's waits block the host until the rows arrived or ``timeout_s`` passed (one host
    synchronisation per receive), except inside CUDA graph capture, where the current stream waits.
    ``collective``: take the all_to_all path over gloo too (the path NCCL and RCCL always take).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        timeout_s: float = DEFAULT_PEER_TIMEOUT_S,
        *,
        collective: bool = False,
    ) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout_s = timeout_s
        backend = dist.get_backend(group)
        self._per_peer = backend == "gloo" and not collective
        # gloo counts a wait's timeout from the wait call; ProcessGroupNCCL (and the other device
        # backends) from when the collective was issued, so they are given the whole timeout.
        self._timeout_from_call = backend == "gloo"

    def _counts_device(self, rows: torch.Tensor) -> torch.device:
        backend = dist.get_backend(self.group)
        return torch.device("cpu") if backend == "gloo" else rows.device

    def _post_per_peer(self, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor]) -> Callable[[], None]:
        """Send ``sends[p]`` to and receive ``recvs[p]`` from every peer p (CPU tensors, gloo); the
        returned wait raises PeerTimeoutError naming the first peer whose rows miss the deadline."""
        works = []
        for peer in range(self.world_size):
            if peer == self.rank:
                recvs[peer].copy_(sends[peer])
                continue
            global_peer = peer if self.group is None else dist.get_global_rank(self.group, peer)
            sent = dist.isend(sends[peer].contiguous(), global_peer, group=self.group)
            works.append((peer, dist.irecv(recvs[peer], global_peer, group=self.group), sent))
        deadline = time.monotonic() + self.timeout_s

        def wait() -> None:
            for peer, received, sent in works:
                for work in (received, sent):
                    left = max(deadline - time.monotonic(), 0.001)
                    try:
                        work.wait(timeout=datetime.timedelta(seconds=left))
                    except RuntimeError as error:
                        raise peer_timeout_error(self.rank, peer, self.timeout_s) from error

        return wait

    def _wait_collective(self, work: dist.Work, posted_at: float, on_gpu: bool, what: str) -> None:
        """Wait for an all_to_all posted at ``posted_at`` (time.monotonic) until ``timeout_s`` after it.
        Over NCCL the timed-out wait aborts the group's communicator before it raises."""
        if on_gpu and torch.cuda.is_current_stream_capturing():
            work.wait()  # a blocking host wait is not allowed while capturing: the stream waits
            return
        left = self.timeout_s
        if self._timeout_from_call:
            left = max(posted_at + self.timeout_s - time.monotonic(), 0.001)
        try:
            work.wait(timeout=datetime.timedelta(seconds=left))
        except RuntimeError as error:
            peers = [peer for peer in range(self.world_size) if peer != self.rank]
            raise collective_timeout_error(self.rank, peers, self.timeout_s, what) from error

    def _variable_per_peer(self, rows: torch.Tensor, send_counts: list[int]) -> Pending:
        counts = torch.tensor(send_counts, dtype=torch.int64)
        recv_counts_t = torch.empty_like(counts)
        self._post_per_peer(list(counts.split(1)), list(recv_counts_t.split(1)))()
        recv_counts = recv_counts_t.tolist()
        host = rows.cpu()
        out = torch.empty((sum(recv_counts), *rows.shape[1:]), dtype=rows.dtype)
        wait = self._post_per_peer(list(host.split(send_counts)), list(out.split(recv_counts)))

        def finish() -> tuple[torch.Tensor, list[int] | None]:
            wait()
            return out.to(rows.device), recv_counts

        return _PostedExchange(finish)

    def variable(self, rows: torch.Tensor, send_counts: list[int]) -> Pending:
        if self._per_peer:
            return self._variable_per_peer(rows, send_counts)
        device = self._counts_device(rows)
        counts = torch.tensor(send_counts, dtype=torch.int64, device=device)
        recv_counts_t = torch.empty_like(counts)
        posted_at = time.monotonic()
        work = dist.all_to_all_single(recv_counts_t, counts, group=self.group, async_op=True)
        self._wait_collective(work, posted_at, counts.is_cuda, "row counts")
        recv_counts = recv_counts_t.tolist()
        out = torch.empty((sum(recv_counts), *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
        posted_at = time.monotonic()
        work = dist.all_to_all_single(out, rows, recv_counts, send_counts, group=self.group, async_op=True)

        def finish() -> tuple[torch.Tensor, list[int] | None]:
            self._wait_collective(work, posted_at, out.is_cuda, "rows")
            return out, recv_counts

        return _PostedExchange(finish)

    def fixed(self, chunks: torch.Tensor) -> Pending:
        send = chunks
        if dist.get_backend(self.group) == "gloo" and chunks.is_cuda:
            send = chunks.cpu()
        out = torch.empty_like(send)
        if self._per_peer:
            wait = self._post_per_peer(list(send.contiguous()), list(out))

            def finish_per_peer() -> tuple[torch.Tensor, list[int] | None]:
                wait()
                return out.to(chunks.device), None

            return _PostedExchange(finish_per_peer)
        posted_at = time.monotonic()
        work = dist.all_to_all_single(out, send.contiguous(), group=self.group, async_op=True)

        def finish() -> tuple[torch.Tensor, list[int] | None]:
            self._wait_collective(work, posted_at, out.is_cuda, "per-rank slots")
            return out.to(chunks.device), None

        return _PostedExchange(finish)


@dataclass
class _Post:
    rows: torch.Tensor
    counts: list[int] | None

    def signature(self) -> tuple:
        """What every rank's k-th exchange must agree on: its kind, row shape and dtype."""
        return ("variable" if self.counts is not None else "fixed", tuple(self.rows.shape[1:]), self.rows.dtype)


@dataclass
class LoopbackHub:
    """The shared state of a loopback world: a mailbox where each rank's k-th exchange meets every other
    rank's k-th (torch provider), and every rank's arena (Triton provider)."""

    world_size: int
    posts: dict[int, dict[int, _Post]] = field(default_factory=dict)
    arenas: dict[int, torch.Tensor] = field(default_factory=dict)  # Triton provider: each rank's arena
    next_seq: list[int] = field(default_factory=list)
    taken: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.next_seq = [0] * self.world_size

    def post(self, rank: int, item: _Post) -> int:
        seq = self.next_seq[rank]
        self.next_seq[rank] += 1
        self.posts.setdefault(seq, {})[rank] = item
        return seq

    def collect(self, seq: int, rank: int) -> list[_Post]:
        posted = self.posts.get(seq, {})
        missing = [r for r in range(self.world_size) if r not in posted]
        if missing:
            raise ExchangeError(
                f"rank {rank} waits on exchange #{seq} but ranks {missing} have not posted it; in a loopback "
                f"world call every rank's *_send before any rank's *_recv (rank {missing[0]} would never send: "
                "one thread drives every rank, so the receive gives up at once instead of waiting "
                "SGLANG_MORI_PEER_TIMEOUT_S)"
            )
        items = [posted[r] for r in range(self.world_size)]
        mine = posted[rank].signature()
        other = next((r for r, item in enumerate(items) if item.signature() != mine), None)
        if other is not None:
            raise ExchangeError(
                f"rank {rank}'s exchange #{seq} ({mine}) does not match rank {other}'s ({items[other].signature()}): "
                "the ranks' calls went out of step (a call refused on one rank was made on the others); a loopback "
                "world cannot recover from that, build a new one"
            )
        self.taken[seq] = self.taken.get(seq, 0) + 1
        if self.taken[seq] == self.world_size:
            del self.posts[seq], self.taken[seq]
        return items


class LoopbackExchange:
    """One rank's view of a LoopbackHub."""

    def __init__(self, hub: LoopbackHub, rank: int) -> None:
        self.hub = hub
        self.rank = rank
        self.world_size = hub.world_size

    def variable(self, rows: torch.Tensor, send_counts: list[int]) -> Pending:
        seq = self.hub.post(self.rank, _Post(rows, list(send_counts)))

        def finish() -> tuple[torch.Tensor, list[int] | None]:
            parts, counts = [], []
            for post in self.hub.collect(seq, self.rank):
                assert post.counts is not None
                start = sum(post.counts[: self.rank])
                count = post.counts[self.rank]
                parts.append(post.rows[start : start + count])
                counts.append(count)
            return torch.cat(parts), counts

        return _PostedExchange(finish)

    def fixed(self, chunks: torch.Tensor) -> Pending:
        seq = self.hub.post(self.rank, _Post(chunks, None))

        def finish() -> tuple[torch.Tensor, list[int] | None]:
            parts = [post.rows[self.rank] for post in self.hub.collect(seq, self.rank)]
            return torch.stack(parts), None

        return _PostedExchange(finish)
