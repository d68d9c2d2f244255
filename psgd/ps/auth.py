"""Who may talk to a shard: a shared secret (token) checked on every request, both transports.

PyTorch documents c10d and RPC as unauthenticated, never to be exposed; a psgd shard that binds
anything but loopback takes pushes that change its weights and answers pulls that reveal them,
so it needs a gate. The gate is a token every process of a run shares:

- Where it comes from: `--token-file PATH` (the file's text, surrounding whitespace stripped), or
  else the environment variable PSGD_TOKEN. config.json records the path, never the secret.
- gRPC (Info, Init, Push, Pull, PushPull, Leave): the client sends it as the metadata entry
  `psgd-token`; a server interceptor compares it in constant time and ends any call that lacks
  it or carries another with UNAUTHENTICATED, before a handler runs (so no state changes).
- TCP data plane: the first frame of every connection is HELLO carrying the token; the server
  answers WELCOME, or ERROR "UNAUTHENTICATED: ..." and closes the connection. A server without a
  token answers WELCOME to any HELLO and does not require one (loopback runs need no secret).
- Binding anything but loopback without a token is refused at start (psgd/train/serve.py) unless
  `--insecure` is given: an open shard must be a decision, not a default.

gRPC's side (the server interceptor, the client channel that sends the token) is in
psgd/ps/grpc_auth.py, so that this module, which the launcher and every process read for the
token, loads no gRPC (the warm parent of psgd/train/zygote.py may preload it).

The token authenticates; it does not encrypt. On a network that others can read, TLS
(psgd/ps/tls.py: --tls-cert/--tls-key on shards, --tls-ca on workers) keeps it and the tensors private.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from pathlib import Path

ENV = "PSGD_TOKEN"
METADATA_KEY = "psgd-token"


class TokenError(ValueError):
    """A token file that cannot be used (missing, unreadable, empty)."""


def load(token_file: str) -> bytes | None:
    """The run's token: the file's stripped text, else $PSGD_TOKEN, else None (no token)."""
    if token_file:
        try:
            text = Path(token_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise TokenError(f"--token-file {token_file}: cannot read it ({e})") from None
        return _checked(text, f"--token-file {token_file}")
    env = os.environ.get(ENV, "").strip()
    return _checked(env, ENV) if env else None


def _checked(text: str, where: str) -> bytes:
    # gRPC metadata values are printable ASCII; a token that is not would fail on every call.
    if not text:
        raise TokenError(f"{where} is empty")
    if not (text.isascii() and text.isprintable()):
        raise TokenError(f"{where}: a token is printable ASCII (e.g. the output of `openssl rand -hex 32`)")
    return text.encode()


def accepts(expected: bytes | None, given: bytes | None) -> bool:
    """Whether a request carrying `given` may pass a gate holding `expected` (None: no gate).
    Constant-time in the token's bytes, so timing does not leak how much of a guess was right."""
    if expected is None:
        return True
    return given is not None and hmac.compare_digest(expected, given)


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and 'localhost'; anything else may be reachable from outside."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything
