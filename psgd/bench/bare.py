"""The bare gRPC service of `psgd bench transport` (psgd/bench/transport.py): gRPC alone, in its own
process, without torch or psgd's wire code loaded (its process starts in a fraction of the time)."""

from __future__ import annotations

import sys

BARE_SERVICE = "psgd.bench.Bare"


def serve_bare(options: list | None = None) -> None:
    """A bare gRPC service on 127.0.0.1:0 (prints its port; stops when stdin closes).

    Sink (client-streaming) drops what it gets; Source (server-streaming) streams back the
    frames the request asks for: `count,size`. No protobuf, no copies of ours. `options`: the
    server's gRPC channel options as (name, value) pairs (transport.py passes psgd's CHANNEL_OPTIONS).
    """
    from concurrent import futures

    import grpc

    def sink(requests, context):
        for _ in requests:
            pass
        return b""

    def source(request: bytes, context):
        count, size = (int(v) for v in request.decode().split(","))
        frame = bytes(size)
        yield b"header"
        for _ in range(count):
            yield frame

    handler = grpc.method_handlers_generic_handler(BARE_SERVICE, {
        "Sink": grpc.stream_unary_rpc_method_handler(sink),
        "Source": grpc.unary_stream_rpc_method_handler(source)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=[tuple(o) for o in options or []])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    sys.stdin.read()
    server.stop(0)
