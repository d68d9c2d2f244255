"""A worker's view of all K parameter shards: parallel push / pull with deadlines.

Contract (ps-lite's worker API, in Python):
- `PSClient(transport, worker_id, num_elements, wire_dtype)`: shard k owns
  `sharding.shard_ranges(num_elements, K)[k]` of the flat vector; `transport`
  (psgd/ps/transport.py: gRPC, raw TCP, either paced by --link) carries the bytes.
  `make_client(name, addresses, ...)` builds one from the run's flags.
- `wait_ready()` blocks (up to the deadline) until every shard answers, and checks that the
  addresses are the shards 0..K-1 in order.
- `join_job(transport, flat)` (psgd worker --join, psgd.connect(join=True); psgd/ps/join.py, re-exported
  here): takes a slot in a running job, the first shard's pick, on every shard; returns (worker
  id, first clock). A shard that refuses leaves the others' admission undone, so no shard waits for it.
- `init(flat)` offers initial values to every shard (the first worker to call wins).
- `pull(clock, out)` fills `out` with the parameters from all shards in parallel; blocks while
  a shard's consistency policy holds it; returns a `PullResult` (done once the budget is spent).
  `start_pull(clock, out)` does the same in the background and returns a `PullStreams` to wait
  on: for the headers, for a range of `out`, or for the result (--overlap uses it;
  psgd/ps/pull_streams.py, with `PullResult`, both re-exported here).
  `wait_admitted(clock, out)` is a scheduled joiner's first pull: asked again each time a shard
  answers that the admission is still to come, as long as the run moves (a long poll).
- `push(clock, grad)` sends each shard its slice in parallel, tagged with the versions the
  last pull returned (with `topk`, only the slice's top entries by magnitude, as indices and
  values; `error_feedback` carries the rest into the next push: psgd/core/sparsify.py);
  `start_push(k, clock, grad)` sends one shard's slice in the background (a Future of its
  reply). Both read `grad` while sending: do not change it until they return.
- `push_pull(clock, grad, out)`: both in one round trip per shard (PushPull): the push of
  `clock`, answered by the pull of clock + 1 into `out`; returns a `PushPulled` (the push's
  outcome, the pull's result, when the replies began to arrive, which splits the round trip
  into its push and pull parts, and how long the shards held it: a sync push waiting for its
  turn, then the pull). A dense one goes through the transport's `push_pull_direct`
  (psgd/ps/transfer.py `Wire`: its fast path where it has one), a sparse one through `push_pull`.
- `push_replies(clock, grad)`: `push`, answered by the shards' PushReplies, each with the time
  the shard held the push for its turn (`wait_s`).
- `lend(count)`: where the transport would keep the worker's flat buffers (`Wire.lend`), when the
  wire carries them as they are (dense fp32); else None.
- The run is over for this worker once a shard says its budget is spent (`done`), or, with
  `all_done` (sync with backup workers), once every shard has said so: there each shard picks
  its own first N-b gradients, so one shard may make its last update before another, which still
  needs this worker's gradients (a done shard's range keeps its last values; its pushes are
  refused and count for nothing).
All methods but those of `PullStreams` are for one thread (one worker thread drives one client);
they block the caller unless named start_*. Every request has the transport's deadline;
failures raise `ExchangeError` with one line.

Copies (see psgd/core/codec.py): a push sends each slice of the gradient from its own memory
(gRPC: one copy into ready-serialised frames; TCP: none); a pull writes each received chunk
once, straight into `out` (the model's flat buffer).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from psgd._proto import parameter_server_pb2 as pb
from psgd.core import codec, sparsify
from psgd.core import link as link_mod
from psgd.core.errors import ExchangeError
from psgd.core.sharding import shard_ranges
from psgd.ps import wire
from psgd.ps.join import join_job as join_job
from psgd.ps.pull_streams import PullResult, PullStreams
from psgd.ps.transfer import push_pull_stepped
from psgd.ps.transport import NO_EVENTS, Events, Transport, make_transport


@dataclass
class PushPulled:
    done: bool           # the budget is spent (said by the push or by the pull)
    refused: bool        # a shard refused the gradient (the budget was spent before it came)
    sent: int            # gradient bytes sent
    pulled: PullResult   # the parameters of the next clock (versions unchanged when done)
    replied_at: float    # perf_counter() when the last shard's reply header arrived
    wait_s: float = 0.0  # the longest any shard held this round trip: the push for its turn, then the pull


class PSClient:
    def __init__(self, transport: Transport, worker_id: int, num_elements: int, wire_dtype: str = "fp32",
                 timeout: float = 60.0, all_done: bool = False, topk: float | sparsify.TopK | None = None,
                 error_feedback: bool = True) -> None:
        self.transport, self.worker_id, self.dtype, self.timeout = transport, worker_id, wire_dtype, timeout
        self.all_done = all_done
        self.addresses = transport.addresses
        self.shards = list(range(len(self.addresses)))
        self.ranges = shard_ranges(num_elements, len(self.addresses))
        # --topk: every push sends the top fraction of each shard's slice (psgd/core/sparsify.py);
        # None: dense pushes. A fraction of 1 still takes the sparse path (every entry, as pairs).
        self.sparsifier = sparsify.Sparsifier(self.ranges, topk, error_feedback) if topk is not None else None
        self.versions = [0] * len(self.addresses)
        self._cuts: dict[tuple, list[torch.Tensor]] = {}  # `_slices`
        # Dense pushes' headers, built once and updated (`push_pull`): a header costs ~8 us to build.
        self._headers = [self._header(k, 0, 0, wire_dtype) for k in self.shards]
        wire.reuse_freed_memory()
        # start_pull / start_push run here, so that K pulls and K pushes fit at once.
        self.background = ThreadPoolExecutor(max_workers=2 * len(self.addresses), thread_name_prefix="psgd-exchange")

    def wait_ready(self) -> list[pb.InfoReply]:
        infos = self.transport.info(self.shards)
        for k, info in enumerate(infos):
            if info.shard != k or info.num_shards != len(self.shards):
                raise ExchangeError(f"{self.addresses[k]} is shard {info.shard} of {info.num_shards}, "
                                    f"expected shard {k} of {len(self.shards)}: check the order of --servers")
        return infos

    def _header(self, k: int, clock: int, base_version: int, dtype: str, sparse_count: int = 0) -> pb.TensorHeader:
        start, stop = self.ranges[k]
        return pb.TensorHeader(worker_id=self.worker_id, clock=clock, base_version=base_version,
                               dtype=wire.DTYPE_ENUMS[dtype], shard=k, num_elements=stop - start,
                               sparse_count=sparse_count)

    def _push_header(self, k: int, clock: int) -> pb.TensorHeader:
        count = self.sparsifier.count_at(k, clock) if self.sparsifier else 0
        return self._header(k, clock, self.versions[k], self.dtype, count)

    def _push_payload(self, grad: torch.Tensor, k: int, clock: int = 0) -> memoryview | sparsify.Sparse:
        """Shard k's slice of `grad` as it goes out: its bytes, or its top entries (--topk)."""
        if self.sparsifier is None:
            return codec.encode(self._slice(grad, k), self.dtype)
        return self.sparsifier.compress(k, self._slice(grad, k), self.dtype, clock)

    def lend(self, count: int):
        """(params, grads) buffers of `count` fp32 the transport would have the worker keep its flat
        buffers in (psgd/ps/transfer.py `Wire.lend`), or None; only where pushes and pulls carry
        them as they are (dense fp32), since the shard reads and writes them in place."""
        if self.sparsifier is not None or self.dtype != "fp32":
            return None
        return self.transport.lend(count)

    def _slices(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Every shard's slice of `flat`, cut once per buffer (not at every step of a small model): the
        cache holds the slices, so no other live tensor can be at the same address."""
        key = (flat.data_ptr(), flat.numel(), flat.dtype)
        cut = self._cuts.get(key)
        if cut is None:
            if len(self._cuts) > 4:  # a caller that passes a new buffer each step keeps few alive
                self._cuts.clear()
            cut = self._cuts[key] = [self._slice(flat, k) for k in self.shards]
        return cut

    def _slice(self, flat: torch.Tensor, k: int) -> torch.Tensor:
        start, stop = self.ranges[k]
        return flat[start:stop]

    def init(self, flat: torch.Tensor) -> None:
        """Offer initial values, always as exact fp32 (the wire dtype is for gradients and pulls)."""
        flat = flat.detach().to("cpu")
        self.transport.init(self.shards, lambda k: self._header(k, 0, 0, "fp32"),
                            lambda k: codec.encode(self._slice(flat, k), "fp32"))

    def _pull(self, shards: list[int], clock: int, out: torch.Tensor, events: Events | None = None) -> list:
        def request(k: int) -> pb.PullRequest:
            return pb.PullRequest(worker_id=self.worker_id, clock=clock, dtype=wire.DTYPE_ENUMS[self.dtype], shard=k)
        return self.transport.pull(shards, request, lambda k: self._slice(out, k), events or NO_EVENTS)

    def over(self, flags) -> bool:
        """Whether the shards' done (or refused) flags end this worker's run (see the module docstring)."""
        return all(flags) if self.all_done else any(flags)

    def pull_result(self, results: list) -> PullResult:
        done = self.over([h.done for h, _ in results])
        if not done:
            self.versions = [h.version for h, _ in results]
        return PullResult(done=done, versions=list(self.versions), wait_s=max(h.wait_s for h, _ in results),
                          clock_gap=max(h.clock_gap for h, _ in results), bytes=sum(b for _, b in results))

    def pull(self, clock: int, out: torch.Tensor) -> PullResult:
        return self.pull_result(self._pull(self.shards, clock, out))

    def wait_admitted(self, clock: int, out: torch.Tensor) -> PullResult:
        """A scheduled joiner's first pull, however far away its admission: a shard holds it for
        half the deadline at most and then refuses it DEADLINE_EXCEEDED (psgd/ps/shard.py), and it
        is asked again for as long as the shards' versions move between asks. A run that stalls
        (no version moved during a whole hold) still fails, with the last refusal's line."""
        last = None
        while True:
            try:
                return self.pull(clock, out)
            except ExchangeError as e:
                if e.code != "DEADLINE_EXCEEDED":
                    raise
                versions = [info.version for info in self.transport.info(self.shards)]
                if versions == last:
                    raise ExchangeError(f"{e} (no shard's version moved while it waited: the run is stalled)",
                                        e.code) from None
                last = versions

    def start_pull(self, clock: int, out: torch.Tensor) -> PullStreams:
        return PullStreams(self, clock, out)

    def push_replies(self, clock: int, grad: torch.Tensor) -> list[pb.PushReply]:
        """`push`, answered by every shard's PushReply (its `wait_s`: how long it held the push for its turn)."""
        return self._push(self.shards, clock, grad.detach().to("cpu"))

    def _push(self, shards: list[int], clock: int, grad: torch.Tensor) -> list[pb.PushReply]:
        return self.transport.push(shards, lambda k: self._push_header(k, clock),
                                   lambda k: self._push_payload(grad, k, clock))

    def start_push(self, k: int, clock: int, grad: torch.Tensor) -> Future:
        return self.background.submit(lambda: self._push([k], clock, grad)[0])

    def push(self, clock: int, grad: torch.Tensor) -> tuple[bool, bool, int]:
        """Send each shard its slice; returns (budget spent, refused by any shard, bytes sent)."""
        return self.push_outcome(self.push_replies(clock, grad))

    def push_outcome(self, replies: list[pb.PushReply]) -> tuple[bool, bool, int]:
        if self.sparsifier is not None:
            sent = sum(self.sparsifier.nbytes(k, self.dtype) for k in self.shards)
        else:
            sent = sum((stop - start) * codec.itemsize(self.dtype) for start, stop in self.ranges)
        return self.over([r.done for r in replies]), self.over([r.refused for r in replies]), sent

    def push_pull(self, clock: int, grad: torch.Tensor, out: torch.Tensor, on_sent: Callable[[], None] | None = None,
                  on_free: Callable[[], None] | None = None) -> PushPulled:
        """Push `grad` of `clock` and pull clock + 1 into `out`, one round trip per shard.
        `on_free()` runs once `grad` may be written again (once every push is out, or for a gradient
        the transport lent, once the shard has read it, if that comes before the reply; else never),
        then `on_sent()` once every push is out, while the replies are awaited (from a transport
        thread)."""
        grad = grad.detach().to("cpu")
        if self.sparsifier is None:  # the headers are reused, the tensors handed over as they are
            for k, h in enumerate(self._headers):
                h.clock, h.base_version = clock, self.versions[k]
            results, replied_at = self.transport.push_pull_direct(self.shards, self._headers, self._slices(grad),
                                                                  self._slices(out), on_sent, on_free)
        else:
            free_then_sent = on_sent if on_free is None else (lambda: (on_free(), on_sent and on_sent()))
            results, replied_at = push_pull_stepped(
                self.transport, self.shards, lambda k: self._push_header(k, clock),
                lambda k: self._push_payload(grad, k, clock), lambda k: self._slice(out, k), free_then_sent)
        done, refused, sent = self.push_outcome([h.pushed for h, _ in results])
        pulled = self.pull_result(results)
        waited = max(h.wait_s + h.pushed.wait_s for h, _ in results)
        return PushPulled(done or pulled.done, refused, sent, pulled, replied_at, waited)

    def close(self, failed: bool = False) -> None:
        """Tell every shard this worker has finished (Leave: the last of N ends the shards' run),
        then close every connection. `failed`: no Leave (the run did not finish: the launcher, or
        whoever started it, stops the shards); first cut the connections still in use (their calls
        end at once instead of at their deadline), then drop what has not started."""
        if failed:
            self.transport.close()
        self.background.shutdown(wait=True, cancel_futures=failed)
        try:
            if not failed:
                self.transport.leave(self.shards, self.worker_id)
        finally:
            self.transport.close()


def make_client(transport: str, addresses: list[str], worker_id: int, num_elements: int, wire_dtype: str = "fp32",
                rpc_timeout: float = 60.0, link: link_mod.Link | None = None, token: bytes | None = None,
                all_done: bool = False, topk: float | sparsify.TopK | None = None, error_feedback: bool = True,
                tls_ca: str = "") -> PSClient:
    """A PSClient on `--transport grpc | tcp | shm` (paced to `link` when given, carrying `token` when given;
    sparse pushes with `topk`)."""
    transport_ = make_transport(transport, addresses, rpc_timeout, link, token, tls_ca)
    return PSClient(transport_, worker_id, num_elements, wire_dtype, rpc_timeout, all_done=all_done, topk=topk,
                    error_feedback=error_feedback)
