"""Helpers of the hostile-client catalogue (hostile_clients_test.py): the cluster under attack,
messages built from the repository's protos, raw sockets and HTTP, the canary."""
import hashlib
import os
import socket
import struct
import threading
import time

import grpc
import numpy as np

LAYER = 1
LIMIT = 128 << 20
OPTIONS = [("grpc.max_receive_message_length", LIMIT), ("grpc.max_send_message_length", LIMIT)]
C = grpc.StatusCode
CANARY_TOKENS = 4
ADMIN = "hostile-test-admin"
MAX_WATCHERS = 32

# The catalogue: (name, case) in the order the case modules register them.
CASES = []


def case(name):
    def register(fn):
        CASES.append((name, fn))
        return fn
    return register


class Ctx:
    """The cluster under attack and the message classes."""

    def __init__(self, cluster, pb, token, ref):
        self.cluster = cluster
        self.pb = pb
        self.token = token
        self.ref = ref
        self.attention = grpc.insecure_channel(cluster["attention"], options=OPTIONS)
        self.router = grpc.insecure_channel(cluster["router"], options=OPTIONS)
        self.shard0 = grpc.insecure_channel(cluster["shards"][0]["endpoint"], options=OPTIONS)
        self.hidden = ref["x"].shape[1]
        self.latent = 0

    def unary(self, channel, method, request, resp_cls=None, timeout=20, metadata=None,
              compression=None):
        call = channel.unary_unary(
            method, request_serializer=lambda m: m if isinstance(m, bytes) else
            m.SerializeToString(), response_deserializer=(resp_cls.FromString if resp_cls
                                                          else None))
        return call(request, timeout=timeout, metadata=metadata, compression=compression)

    def member(self):
        """An attention node's member token (Dispatch, OpenDataPlane, ReportStats)."""
        return [("x-moe-cluster-token", self.token)]

    def expert_member(self, shard="shard-0"):
        """The member token of an expert named shard (RegisterExpertServer, Heartbeat): hex
        SHA-256 of "<secret>:expert:<shard>", what the deployment gives that shard alone."""
        token = hashlib.sha256(f"{self.cluster_secret}:expert:{shard}".encode()).hexdigest()
        return [("x-moe-cluster-token", token)]


def expect(code, substring, fn):
    """fn() must fail with code and a message containing substring; returns the message."""
    try:
        fn()
    except grpc.RpcError as e:
        assert e.code() == code, f"wanted {code}, got {e.code()}: {e.details()}"
        assert substring in (e.details() or ""), f"{substring!r} not in {e.details()!r}"
        return f"{e.code().name}: {e.details()}"
    raise AssertionError(f"wanted {code} ({substring!r}), the call succeeded")


def tensor(pb, data, shape, dtype=None):
    t = pb.tensor.Tensor()
    t.dtype = pb.tensor.DTYPE_BF16 if dtype is None else dtype
    t.shape.extend(shape)
    t.data = data
    return t


def forward_request(ctx, x_bits=None, shape=None, dtype=None, layer=LAYER, data=None, mode=0):
    pb = ctx.pb
    r = pb.attention.ForwardRequest()
    r.layer = layer
    if x_bits is None:
        x_bits = ctx.ref["x"]
    r.hidden_states.CopyFrom(tensor(pb, x_bits.tobytes() if data is None else data,
                                    list(x_bits.shape) if shape is None else shape, dtype))
    r.options.reply_mode = mode
    return r


def forward(ctx, req, timeout=20, compression=None):
    return ctx.unary(ctx.attention, "/moe.v1.AttentionService/Forward", req,
                     ctx.pb.attention.ForwardResponse, timeout=timeout, compression=compression)


def bf16(values):
    f = np.asarray(values, dtype=np.float32)
    return (f.view(np.uint32) >> 16).astype(np.uint16)


def dispatch_stream(ctx, requests, metadata=None, timeout=20):
    """Sends the requests on one Dispatch stream to shard-0; returns the replies (or raises)."""
    call = ctx.shard0.stream_stream(
        "/moe.v1.ExpertService/Dispatch",
        request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
        response_deserializer=ctx.pb.expert.DispatchReply.FromString)
    return list(call(iter(requests), timeout=timeout, metadata=metadata))


def batch(ctx, expert=1, rows=3, values=None, **fields):
    pb = ctx.pb
    r = pb.expert.DispatchRequest()
    r.batch_id = fields.pop("batch_id", 1)
    r.layer = LAYER
    g = r.groups.add()
    g.expert_id = expert
    g.token_count = rows
    z = bf16(np.full(rows * ctx.latent, 0.25) if values is None else values)
    r.activations.CopyFrom(tensor(pb, z.tobytes(), [rows, ctx.latent]))
    for k, v in fields.items():
        if k in ("row_source", "token_index", "weights"):
            getattr(r, k).extend(v)
        else:
            setattr(r, k, v)
    return r


def dispatch_error(ctx, req, code_name, substring, metadata="member"):
    """One batch as a member; its reply must carry the code and message (the stream goes on)."""
    replies = dispatch_stream(ctx, [req], metadata=ctx.member() if metadata == "member" else
                              metadata)
    assert len(replies) == 1, replies
    got = C(grpc.StatusCode.OK.value) if replies[0].code == 0 else None
    names = {c.value[0]: c for c in grpc.StatusCode}
    got = names.get(replies[0].code)
    assert got is not None and got.name == code_name, (replies[0].code, replies[0].message)
    assert substring in replies[0].message, (substring, replies[0].message)
    return f"{code_name}: {replies[0].message}"


def raw_exchange(endpoint, payload, wait=3.0):
    """Raw bytes to host:port; returns what came back before the peer closed (or wait s)."""
    host, port = endpoint.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=wait)
    try:
        s.sendall(payload)
        s.settimeout(wait)
        out = b""
        deadline = time.time() + wait
        while time.time() < deadline:
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                break
            if not chunk:
                break
            out += chunk
        return out
    finally:
        s.close()


def http(endpoint, method, path, headers=None, body=b""):
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
    for k, v in (headers or {}).items():
        head += f"{k}: {v}\r\n"
    r = raw_exchange(endpoint, head.encode() + b"\r\n" + body, wait=10)
    status = int(r[9:12]) if len(r) >= 12 else 0
    return status, r.split(b"\r\n\r\n", 1)[-1].decode(errors="replace")


def stats(ctx):
    r = ctx.pb.router.GetLoadStatsRequest()
    r.layer = LAYER
    return ctx.unary(ctx.router, "/moe.v1.RouterService/GetLoadStats", r, ctx.pb.router.LoadStats)


def placement(ctx):
    """The shards and their ranges (not the heartbeat ages)."""
    p = ctx.unary(ctx.router, "/moe.v1.RouterService/GetPlacement",
                  ctx.pb.router.GetPlacementRequest(), ctx.pb.router.Placement)
    return sorted((s.shard, s.endpoint, str(list(s.ranges))) for s in p.shards)


def rss(pid):
    """(private, shared) resident bytes: RssAnon + RssFile (what a process grows by itself),
    and RssShmem (shared memory it maps: the shm lane's rings, UCX's FIFOs)."""
    kb = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "RssShmem"):
                kb[key] = int(value.split()[0])
    return ((kb.get("RssAnon", 0) + kb.get("RssFile", 0)) * 1024, kb.get("RssShmem", 0) * 1024)


class Canary(threading.Thread):
    """The same Forward (per-pair replies) every 50 ms; every answer must be bit-exact."""

    def __init__(self, ctx, seconds):
        super().__init__(daemon=True)
        self.ctx = ctx
        self.until = time.time() + seconds
        self.stop = threading.Event()
        self.ok = self.wrong = self.failed = 0
        self.errors = []

    def run(self):
        req = forward_request(self.ctx, mode=1)
        want = self.ctx.ref["out"].tobytes()
        while not self.stop.is_set() and time.time() < self.until:
            try:
                r = forward(self.ctx, req, timeout=10)
                if r.output.data == want:
                    self.ok += 1
                else:
                    self.wrong += 1
            except grpc.RpcError as e:
                self.failed += 1
                self.errors.append(f"{e.code().name}: {e.details()}")
            self.stop.wait(0.05)


def h2_frame(kind, flags, stream, payload=b""):
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(
        ">I", stream) + payload


def h2_headers(path, authority):
    """HPACK (RFC 7541) by hand: POST, http, the path, the authority, gRPC's content-type, te."""
    def lit(index, value):  # literal with incremental indexing, indexed name
        return bytes([0x40 | index, len(value)]) + value
    return (b"\x83\x86" + lit(4, path.encode()) + lit(1, authority.encode()) +
            lit(31, b"application/grpc") + b"\x40\x02te\x08trailers")


def h2_connect(endpoint):
    host, port = endpoint.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + h2_frame(4, 0, 0))  # preface, SETTINGS
    return s


def alive(pid):
    """Running (a zombie, exited but not yet reaped by moe-cli, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop_under_load(ctx, pids):
    """SIGTERM to every server while heavy requests run: each exits within 3 s, docs/security.md's
    promise (its 2 s grace for running calls, then its own teardown: the HTTP servers' stops
    are woken at once)."""
    x = np.tile(ctx.ref["x"], (512, 1))
    stop = threading.Event()

    def load():
        while not stop.is_set():
            try:
                forward(ctx, forward_request(ctx, x), timeout=5)
            except grpc.RpcError:
                stop.wait(0.05)

    threads = [threading.Thread(target=load, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    took = {}
    for name in ("attention-svc", "shard-0", "shard-1", "router-svc"):
        t = time.time()
        os.kill(pids[name], 15)
        while alive(pids[name]) and time.time() - t < 10:
            time.sleep(0.02)
        took[name] = time.time() - t
    stop.set()
    slow = {n: s for n, s in took.items() if s > 3.0}
    assert not slow, f"past the grace period: {slow}"
    return ", ".join(f"{n} {1000 * s:.0f} ms" for n, s in took.items())
