"""Tensor-parallel communication: a process group of two ranks (TP=2 across machines).

``Group(rank, size, addr, rails=[], timeout=30.0, transport="tcp", handshake="", token="")``

* Rank 0 listens on ``addr`` ("HOST:PORT"); rank 1 connects to it (retrying until
  ``timeout``). ``size=1`` is a no-op group without sockets.
* ``rails``: this rank's local IP for each rail (e.g. one per NIC). Each rail is its own TCP
  connection bound to that address; large messages are striped over the live rails by their
  measured throughput, small ones (<= 64 KiB) go in one piece on one rail. If a rail dies the
  traffic moves to the others (``stats()['rail_failures']`` counts it).
* ``handshake``: any string that must match on both ranks (model hash, TP layout, formats).
  On a mismatch the connecting rank (1) raises ``ValueError`` at once; the listening rank (0)
  logs the rejected connection on stderr and keeps listening for the right peer, raising
  ``RuntimeError`` (with the reason of the last rejection) when ``timeout`` passes. Garbage,
  silent or half-open connections to rank 0's port are rejected the same way.
* ``token``: an optional shared secret (both ranks the same). Each side proves it knows the
  token with HMAC-SHA256 over both ranks' random nonces; the token itself never crosses the
  wire. Use one whenever rank 0's port can be reached by anyone but the peer.
* Every wait is bounded by ``timeout`` seconds: a lost peer raises ``RuntimeError("peer
  lost: ...")``, never hangs. After such an error the group is unusable.

Methods (all release the GIL while communicating):

* ``all_reduce(array, dtype="")``: in-place sum of a C-contiguous float32 / float16 array
  (bfloat16: pass a uint16 array and ``dtype="bf16"``). The sum is taken in rank order, so
  both ranks end with bit-identical results. Returns the array.
* ``broadcast(array, root=0)``: root's bytes into every rank's array, in place.
* ``barrier()``; ``stats() -> dict``; ``rank``; ``size``; ``close()``.

Example (two machines, two NICs each)::

    from tensorfold.comm import Group
    g = Group(rank=0, size=2, addr="10.0.0.1:29500", rails=["10.0.0.1", "10.1.0.1"],
              handshake=model_sha256)
    g.all_reduce(partial_sums)   # numpy float32, in place
"""
from __future__ import annotations

from ._core import comm as _comm

Group = _comm.Group

__all__ = ["Group"]
