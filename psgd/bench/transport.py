"""`psgd bench transport`: psgd's push / pull against a raw TCP socket moving the same bytes.

Contract: one run measures, side by side on 127.0.0.1,
- the ceiling: a plain TCP socket (`sendall` of the whole buffer, `recv_into` a preallocated one),
- psgd's push and pull of `--size-mb` MiB of fp32 against K = 1, 2, 4 shard processes
  (`psgd server --mode async --workers 1`, so nothing ever blocks on a policy), on each of
  `--transports`: grpc and tcp (`psgd/ps/transport.py`; the raw-socket data plane is psgd/ps/tcp_server.py),
- the shards' optimizer step (`apply`), reported apart: in async mode it runs inside the Push
  RPC, so `push_net` = push time minus the slowest shard's apply time is the transport alone,
- small messages: one full step's exchange of a `--small-params` model over 2 shards, as two calls
  (pull + push) and as one PushPull (the default), on each transport, against one bare unary
  gRPC round trip (`Info`) on the same channel,
- gRPC's own floor, to tell gRPC's cost from psgd's: a bare gRPC service (`serve_bare`, identity
  serialisers, no psgd code, in its own process) streaming the same 1 MiB frames pre-built, and
  the same small-message pattern (2 parallel server-streaming + 2 client-streaming calls).
With `--device cuda` the pushed gradient and the pulled parameters are device tensors, staged
through pinned host buffers as a GPU worker's are (psgd/ps/staging.py): the bulk rows then include
those copies (the raw socket and the small-message rows stay host-to-host).
Every figure is a median over `--repeat` timed runs after one warm-up; rates are reported as
ratios to the raw socket measured in the same run, because this machine is shared and noisy.
Server processes bind 127.0.0.1:0 and are always stopped (SIGTERM, then their stats are read).

    psgd bench transport --size-mb 64 --json
    psgd bench transport --size-mb 4 --shards 1,2 --repeat 3      # quick look
    psgd bench transport --device cuda --size-mb 16 --small-params 0   # a GPU worker's tensors
"""

from __future__ import annotations

import contextlib
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

import psgd.bench as bench
from psgd.bench.bare import BARE_SERVICE, serve_bare  # noqa: F401 - serve_bare: transport's, as before
from psgd.core.config import RunConfig
from psgd.train import hosts, roles, supervise

MIB = 1 << 20
LOOPBACK = hosts.Seat()  # a server on 127.0.0.1, as always


def parse_int_list(text: str, flag: str) -> list[int]:
    """"1,2,4" -> [1, 2, 4]; raises UsageError naming the flag."""
    from psgd.core.errors import UsageError

    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{flag} expects comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise UsageError(f"{flag} expects integers >= 1, got {text!r}")
    return values


def raw_socket_seconds(nbytes: int, repeat: int) -> list[float]:
    """Seconds to move nbytes over a loopback TCP socket and get a 1-byte ack, `repeat` times.

    The receiver is a thread: `recv_into` and `sendall` release the GIL inside the syscall, so
    the two ends run in parallel as two processes would.
    """
    payload = memoryview(bytearray(nbytes))
    sink = memoryview(bytearray(nbytes))
    times: list[float] = []
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def receive() -> None:
            conn, _ = listener.accept()
            with conn:
                for _ in range(repeat + 1):
                    got = 0
                    while got < nbytes:
                        n = conn.recv_into(sink[got:], nbytes - got)
                        assert n > 0, "raw-socket sender closed early"
                        got += n
                    conn.sendall(b"k")

        thread = threading.Thread(target=receive, daemon=True)
        thread.start()
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(repeat + 1):
                t0 = time.perf_counter()
                s.sendall(payload)
                assert s.recv(1) == b"k"
                times.append(time.perf_counter() - t0)
        thread.join()
    return times[1:]  # the first one warms the socket buffers up


@contextlib.contextmanager
def shard_servers(num_shards: int, out: Path, workers: int = 1, mode: str = "async",
                  extra: list[str] | None = None, seat: hosts.Seat = LOOPBACK) -> Iterator[list[str]]:
    """Start K `psgd server` processes on 127.0.0.1:0 (forked from psgd.bench.ZYGOTE if set, else
    exec'd); yield their addresses; always stop them.
    `seat`: where instead, as `psgd run --hosts` seats a server (a cluster host's `ip netns exec`
    and address; the shard then wants a token: $PSGD_TOKEN, which the children inherit).

    After the block the shards have written `out/shard-K.json` (their stats) on SIGTERM.
    """
    cfg = RunConfig(mode=mode, workers=workers, servers=num_shards, steps=10**9, eval_every=0, out=str(out))
    exe = [*seat.prefix, sys.executable, "-m", "psgd", "server", *roles.flags_for(cfg, "shard"), *(extra or [])]
    exe += ["--bind", seat.bind] if seat.bind else []
    (out / "logs").mkdir(parents=True, exist_ok=True)
    children: list[supervise.Child] = []
    try:
        env = {**supervise.child_env(), **dict(seat.env)}
        for k in range(num_shards):
            children.append(supervise.Child(f"server {k}", exe + ["--shard", str(k), "--port", "0"],
                                            out / "logs" / f"server-{k}.log", env, capture_stdout=True,
                                            zygote=bench.ZYGOTE))  # forked from it if set (on loopback)
        yield [supervise.read_ready(c) for c in children]
    finally:
        supervise.stop(children)


def shard_stats(out: Path, num_shards: int) -> list[dict]:
    return [json.loads((out / f"shard-{k}.json").read_text()) for k in range(num_shards)]


@contextlib.contextmanager
def fresh_client(num_shards: int, num_elements: int, transport: str = "grpc", seat: hosts.Seat = LOOPBACK):
    """Worker 0's client (of `transport`) on K fresh shard processes (at `seat`), initialised with zeros.
    Yields (client, stats): `stats` is filled with the shards' shard-K.json once they stopped."""
    from psgd.ps import auth
    from psgd.ps.client import make_client

    stats: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="psgd-bench-") as tmp:
        with shard_servers(num_shards, Path(tmp), extra=["--params", str(num_elements)], seat=seat) as addresses:
            token = dict(seat.env).get(auth.ENV)  # the seat's shard wants this one; else $PSGD_TOKEN, if set
            client = make_client(transport, addresses, 0, num_elements,
                                 token=token.encode() if token else auth.load(""))
            try:
                client.wait_ready()
                client.init(torch.zeros(num_elements))
                yield client, stats
            finally:
                client.close()
        stats.extend(shard_stats(Path(tmp), num_shards))


def measure_push_pull(num_shards: int, num_elements: int, repeat: int, transport: str = "grpc",
                      device: str = "cpu", seat: hosts.Seat = LOOPBACK) -> dict:
    """Median push / pull seconds of num_elements fp32 over K shards (at `seat`), and the shards' apply time.

    On a CUDA `device` the gradient and the parameters live there, as a GPU worker's do: a push
    includes the device-to-host copy into pinned staging, a pull the copy back (psgd/ps/staging.py)."""
    from psgd.ps.staging import HostStaging

    grad = (torch.randn(num_elements) * 1e-3).to(device)
    out_buf = torch.empty(num_elements, device=device)
    staging = HostStaging(out_buf, grad)
    push_s, pull_s = [], []
    with fresh_client(num_shards, num_elements, transport, seat) as (client, stats):
        for clock in range(repeat + 1):
            t0 = time.perf_counter()
            client.push(clock, staging.host_copy(grad))
            t1 = time.perf_counter()
            client.pull(clock + 1, staging.host_params())
            staging.to_device().wait()
            t2 = time.perf_counter()
            if clock:  # the first round trip is a warm-up
                push_s.append(t1 - t0)
                pull_s.append(t2 - t1)
    # Pushes are sequential, so the slowest shard's mean apply is inside every push's time.
    apply_s = max(s["apply_s"] / max(1, s["version"]) for s in stats)
    return {"push_s": statistics.median(push_s), "pull_s": statistics.median(pull_s), "apply_s": apply_s}


def measure_small(num_shards: int, num_elements: int, repeat: int, transport: str = "grpc") -> dict:
    """Median seconds of one step's exchange as two calls (pull + push, `--separate-pull`), as one
    PushPull (the default), and of one bare unary Info round trip, interleaved."""
    grad = torch.randn(num_elements) * 1e-3
    out_buf = torch.empty(num_elements)
    warm = max(5, repeat // 10)
    exchange, combined, rtt = [], [], []
    with fresh_client(num_shards, num_elements, transport) as (client, _):
        clock = 0
        for i in range(repeat + warm):
            t0 = time.perf_counter()
            client.pull(clock, out_buf)
            client.push(clock, grad)
            t1 = time.perf_counter()
            client.push_pull(clock + 1, grad, out_buf)  # pushes clock + 1, pulls clock + 2
            t2 = time.perf_counter()
            client.transport.info([0])  # one unary gRPC round trip (both transports ask Info on gRPC)
            t3 = time.perf_counter()
            clock += 2
            if i >= warm:
                exchange.append(t1 - t0)
                combined.append(t2 - t1)
                rtt.append(t3 - t2)
    return {"exchange_s": statistics.median(exchange), "combined_s": statistics.median(combined),
            "unary_rtt_s": statistics.median(rtt)}


@contextlib.contextmanager
def bare_servers(count: int) -> Iterator[list]:
    """Start `count` bare gRPC servers (own processes); yield a (Sink, Source) pair per server."""
    import subprocess

    import grpc

    from psgd.ps.wire import CHANNEL_OPTIONS

    procs, channels = [], []
    try:
        for _ in range(count):
            procs.append(subprocess.Popen(
                # psgd/bench/bare.py: gRPC alone, without torch (CHANNEL_OPTIONS travel as JSON).
                [sys.executable, "-c", "import json, sys; from psgd.bench.bare import serve_bare; "
                 "serve_bare(json.loads(sys.argv[1]))", json.dumps(CHANNEL_OPTIONS)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=supervise.child_env()))
        calls = []
        for proc in procs:
            channels.append(grpc.insecure_channel(f"127.0.0.1:{int(proc.stdout.readline())}", CHANNEL_OPTIONS))
            calls.append((channels[-1].stream_unary(f"/{BARE_SERVICE}/Sink"),
                          channels[-1].unary_stream(f"/{BARE_SERVICE}/Source")))
        yield calls
    finally:
        for c in channels:
            c.close()
        for proc in procs:
            proc.stdin.close()
            proc.wait(timeout=30)


def measure_bare(nbytes: int, repeat: int, small_bytes: int, small_repeat: int) -> dict:
    """gRPC alone: bulk push / pull of nbytes in pre-built 1 MiB frames, and the small pattern."""
    from concurrent.futures import ThreadPoolExecutor

    from psgd.core import codec

    frames = [bytes(min(codec.CHUNK_BYTES, nbytes - i)) for i in range(0, nbytes, codec.CHUNK_BYTES)]
    result: dict = {}
    with bare_servers(2) as calls:
        (sink, source), _ = calls
        push_s, pull_s = [], []
        for _ in range(repeat + 1):
            t0 = time.perf_counter()
            sink(iter([b"header", *frames]))
            t1 = time.perf_counter()
            for _ in source(f"{len(frames)},{codec.CHUNK_BYTES}".encode()):
                pass
            push_s.append(t1 - t0)
            pull_s.append(time.perf_counter() - t1)
        result.update(push_s=statistics.median(push_s[1:]), pull_s=statistics.median(pull_s[1:]))
        if small_bytes:
            half = bytes(small_bytes // 2)
            pool = ThreadPoolExecutor(max_workers=2)
            ask = f"1,{len(half)}".encode()
            times = []
            for _ in range(small_repeat + 10):
                t0 = time.perf_counter()
                list(pool.map(lambda c: list(c[1](ask)), calls))
                list(pool.map(lambda c: c[0](iter([b"header", half])), calls))
                times.append(time.perf_counter() - t0)
            pool.shutdown()
            result["small_exchange_s"] = statistics.median(times[10:])
    return result


def run(size_mb: float, shards: list[int], repeat: int, small_params: int, small_repeat: int,
        transports: tuple[str, ...] = ("grpc", "tcp"), device: str = "cpu") -> dict:
    torch.set_num_threads(1)  # like a worker process (supervise.child_env sets OMP_NUM_THREADS=1)
    num_elements = int(size_mb * MIB) // 4
    nbytes = num_elements * 4
    raw_samples: list[float] = []
    rows = []
    for transport in transports:
        for k in shards:
            # Raw socket right before each psgd measurement: drift on a shared machine hits both.
            raw_samples += raw_socket_seconds(nbytes, repeat)
            m = measure_push_pull(k, num_elements, repeat, transport, device)
            rows.append({"transport": transport, "shards": k, "device": device, **m})
    raw_samples += raw_socket_seconds(nbytes, repeat)
    bare = measure_bare(nbytes, repeat, small_params * 4, small_repeat)
    raw_s = statistics.median(raw_samples)
    for r in rows:
        r["push_gbps"] = nbytes / r["push_s"] / 1e9
        r["pull_gbps"] = nbytes / r["pull_s"] / 1e9
        r["push_ratio"] = raw_s / r["push_s"]
        r["pull_ratio"] = raw_s / r["pull_s"]
        net = max(r["push_s"] - r["apply_s"], 1e-9)
        r["push_net_ratio"] = raw_s / net
        r["apply_gbps"] = nbytes / r["shards"] / max(r["apply_s"], 1e-9) / 1e9  # per shard, in parallel
    result: dict = {
        "size_mb": size_mb, "bytes": nbytes, "repeat": repeat, "device": device,
        "raw_socket": {"seconds": raw_s, "gbps": nbytes / raw_s / 1e9},
        "grpc_bare": {"push_s": bare["push_s"], "pull_s": bare["pull_s"], "push_ratio": raw_s / bare["push_s"],
                      "pull_ratio": raw_s / bare["pull_s"]},
        "psgd": rows,
        "small": [],
    }
    if small_params:
        result["grpc_bare"]["small_exchange_s"] = bare["small_exchange_s"]
        for transport in transports:
            small = measure_small(2, small_params, small_repeat, transport)
            small["ratio"] = small["exchange_s"] / small["unary_rtt_s"]
            small["combined_ratio"] = small["combined_s"] / small["unary_rtt_s"]
            # The bare pattern against the round trip measured beside this transport's exchanges.
            small["bare_ratio"] = bare["small_exchange_s"] / small["unary_rtt_s"]
            result["small"].append({"transport": transport, "params": small_params, "shards": 2, **small})
    return result


def format_table(r: dict) -> str:
    lines = [f"raw TCP socket, {r['size_mb']:g} MiB: {r['raw_socket']['gbps']:.2f} GB/s "
             f"(median of {r['repeat']}, {r['raw_socket']['seconds'] * 1e3:.1f} ms)",
             f"bare gRPC, same 1 MiB frames pre-built: push {r['grpc_bare']['push_ratio']:.2f} x raw, "
             f"pull {r['grpc_bare']['pull_ratio']:.2f} x raw (gRPC's own ceiling)",
             "transport  shards  push GB/s  x raw  push-apply x raw  pull GB/s  x raw  apply ms (GB/s per shard)"]
    for row in r["psgd"]:
        lines.append(f"{row['transport']:>9}  {row['shards']:>6}  {row['push_gbps']:>9.2f}  {row['push_ratio']:>5.2f}  "
                     f"{row['push_net_ratio']:>16.2f}  {row['pull_gbps']:>9.2f}  {row['pull_ratio']:>5.2f}  "
                     f"{row['apply_s'] * 1e3:>8.1f} ({row['apply_gbps']:.2f})")
    for s in r["small"]:
        lines.append(f"small, {s['transport']}: exchange (pull + push) of {s['params']} params over {s['shards']} "
                     f"shards {s['exchange_s'] * 1e3:.2f} ms = {s['ratio']:.2f} x a bare unary gRPC round trip "
                     f"({s['unary_rtt_s'] * 1e3:.2f} ms); as one PushPull {s['combined_s'] * 1e3:.2f} ms = "
                     f"{s['combined_ratio']:.2f} x")
    if r["small"]:
        lines.append(f"small, bare gRPC making the same calls: {r['grpc_bare']['small_exchange_s'] * 1e3:.2f} ms "
                     f"= {r['small'][0]['bare_ratio']:.2f} x")
    return "\n".join(lines)


def bench_device(spec: str) -> str:
    """--device cpu | cuda | cuda:N -> "cpu" or "cuda:K" on this host; UsageError if absent or malformed."""
    from psgd.core.devices import DeviceError, parse_device
    from psgd.core.errors import UsageError
    from psgd.train.worker import worker_device

    try:
        if parse_device(spec)[0] == "auto":
            raise ValueError("--device of psgd bench transport is cpu, cuda or cuda:N (auto would hide which)")
        return str(worker_device(spec, rank=0))
    except (DeviceError, ValueError) as e:
        raise UsageError(str(e)) from None


def main(argv: list[str]) -> int:
    from psgd.core.errors import Parser, UsageError

    p = Parser(prog="psgd bench transport", description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=float, default=64.0, help="MiB of fp32 per push / pull (default 64)")
    p.add_argument("--shards", default="1,2,4", help="shard counts to measure, comma-separated")
    p.add_argument("--repeat", type=int, default=5, help="timed repetitions per figure (median reported)")
    p.add_argument("--small-params", type=int, default=100_000,
                   help="parameters of the small-message exchange (0: skip it)")
    p.add_argument("--small-repeat", type=int, default=200, help="timed small-message exchanges")
    p.add_argument("--transports", default="grpc,tcp",
                   help="psgd transports to measure, comma-separated: grpc, tcp (default both)")
    p.add_argument("--device", default="cpu", metavar="cpu|cuda|cuda:N",
                   help="where the pushed gradient and the pulled parameters live (default cpu); on a GPU the bulk "
                        "push / pull times include the copies through pinned host memory")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--out", default="", help="also write the JSON result to this file")
    a = p.parse_args(argv)
    if a.size_mb <= 0 or a.repeat < 1 or a.small_params < 0 or a.small_repeat < 1:
        raise UsageError("--size-mb must be > 0, --repeat and --small-repeat >= 1, --small-params >= 0")
    transports = tuple(t.strip() for t in a.transports.split(",") if t.strip())
    if not transports or not set(transports) <= {"grpc", "tcp"}:
        raise UsageError(f"--transports takes grpc and / or tcp, comma-separated; got {a.transports!r}")
    result = run(a.size_mb, parse_int_list(a.shards, "--shards"), a.repeat, a.small_params, a.small_repeat,
                 transports, bench_device(a.device))
    result["command"] = "psgd bench transport " + " ".join(argv)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1) if a.json else format_table(result))
    return 0
