"""`--transport shm`, one room: the TCP data plane's frames with their payloads (and on x86-64 the
frames themselves) in shared memory, for workers on their shards' host. `auto` (the default)
takes it wherever every shard is on this host's loopback (psgd/ps/transport.py `choose`).

Why: on one host a push's bytes need not cross the kernel's TCP stack at all. A gradient takes a
loopback TCP send and receive each way, each a pass through the kernel, and for a small MLP that
is as long as its whole step; a copy into memory both processes map is a memcpy. BytePS moves
tensors between the co-located processes of a machine the same way.

The contract, per data-plane connection (psgd/ps/framing.py's frames, two more ops):

    ATTACH  the name of a file in /dev/shm the worker created  ->  WELCOME, or ERROR and nothing changes
    BELL    the same, optionally "NAME@AT"                     ->  as ATTACH; then the doorbell

After a WELCOME every frame on that connection carries its payload in the segment instead of on
the socket: the prefix still says how many bytes, and they are at the segment's start (a reply's at
byte AT when BELL named one). A request's payload is read in full before its reply is written, so
one region can serve both ways. The worker sizes the segment for the larger of a request's payload
and its expected reply, and attaches a bigger one when a request needs more. The shard unlinks the
file as it maps it (the worker too, once answered): both processes hold the memory, nothing is left
in /dev/shm when either dies. A worker killed before its shard mapped the file cannot remove it;
the next segment made on the host sweeps the files of makers that no longer run (segment.py `sweep`).
After BELL's WELCOME the frames' prefixes and headers go through the segment's last page too
(bell.py, x86-64 only): the socket is left to wake a peer that sleeps and to say EOF.

The room:
- transport.py `ShmTransport`: the worker's side (a TcpTransport whose payloads move through the
  segments; its fast `push_pull_direct` and `lend`, the `Wire` calls of psgd/ps/transfer.py);
- serve.py: the shard's side, the ops ATTACH and BELL that upgrade a connection of
  psgd/ps/tcp_server.py to `SegmentFrames` (handed to the server through the registry's `upgrades`);
- segment.py `Segment`: a mapped file of /dev/shm and its bounds; `spin_for`, when a waiting side spins;
- bell.py `Bell`: the doorbell, a connection's frames in its segment's last page;
- rows.py: the rows protocol (`--embeddings rows|hybrid`) on the same segments and doorbell, a row
  service's connection upgraded by ATTACH (the registry's `row_client` and `row_upgrades`).
Nothing outside this folder names it but the registry's line in psgd/ps/transport.py
(tests/test_plugin_transport.py counts the files).
"""

from psgd.ps.shm.transport import ShmTransport

__all__ = ["ShmTransport"]
