"""gRPC's side of psgd/ps/auth.py's token: a server interceptor that ends calls without it, and a
client channel that sends it with every call (metadata `psgd-token`)."""

from __future__ import annotations

import grpc

from psgd.ps.auth import METADATA_KEY, accepts


class ServerGate(grpc.ServerInterceptor):
    """Ends every call without the right `psgd-token` metadata with UNAUTHENTICATED."""

    def __init__(self, token: bytes) -> None:
        self.token = token

        def deny(_request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong psgd token (--token-file / PSGD_TOKEN)")

        self._deny = {
            (False, False): grpc.unary_unary_rpc_method_handler(deny),
            (False, True): grpc.unary_stream_rpc_method_handler(deny),
            (True, False): grpc.stream_unary_rpc_method_handler(deny),
            (True, True): grpc.stream_stream_rpc_method_handler(deny),
        }

    def intercept_service(self, continuation, handler_call_details):
        given = dict(handler_call_details.invocation_metadata or ()).get(METADATA_KEY)
        handler = continuation(handler_call_details)
        if accepts(self.token, given.encode() if isinstance(given, str) else given) or handler is None:
            return handler
        # The refusal takes the handler's own shape, so that the client sees a status, not a
        # protocol error; its request is never read into the shard.
        return self._deny[(handler.request_streaming, handler.response_streaming)]


class _ClientToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `psgd-token` to the metadata of every call on a channel."""

    def __init__(self, token: bytes) -> None:
        self.entry = (METADATA_KEY, token.decode())

    def _with_token(self, details):
        return details._replace(metadata=[*(details.metadata or ()), self.entry])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._with_token(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._with_token(details), request_iterator)


def channel(address: str, options: list, token: bytes | None,
            credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    """A channel to `address` (TLS with `credentials`, psgd/ps/tls.py) that sends the token with
    every call when there is one."""
    ch = grpc.secure_channel(address, credentials, options=options) if credentials else \
        grpc.insecure_channel(address, options=options)
    return grpc.intercept_channel(ch, _ClientToken(token)) if token else ch
