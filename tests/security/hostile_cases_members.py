"""Hostile clients of expert-svc (Dispatch and the data plane) and router-svc (membership,
statistics, admin), strangers and members holding a token (the catalogue of
hostile_clients_test.py)."""
import os
import time

import grpc
import numpy as np

from hostile_lib import (ADMIN, C, LAYER, MAX_WATCHERS, batch, case, dispatch_error,
                         dispatch_stream, expect, placement, stats, tensor)


# expert-svc: Dispatch and the data plane
@case("Dispatch without the cluster token")
def _(ctx):
    return expect(C.UNAUTHENTICATED, "needs the cluster token",
                  lambda: dispatch_stream(ctx, [batch(ctx)]))


@case("Dispatch with a wrong cluster token")
def _(ctx):
    return expect(C.UNAUTHENTICATED, "needs the cluster token", lambda: dispatch_stream(
        ctx, [batch(ctx)], metadata=[("x-moe-cluster-token", "0" * 32)]))


@case("OpenDataPlane without the cluster token")
def _(ctx):
    r = ctx.pb.expert.OpenDataPlaneRequest()
    r.node = "stranger"
    return expect(C.UNAUTHENTICATED, "needs the cluster token", lambda: ctx.unary(
        ctx.shard0, "/moe.v1.ExpertService/OpenDataPlane", r, ctx.pb.expert.OpenDataPlaneReply))


@case("OpenDataPlane: 200 random bytes in the retired worker-address field")
def _(ctx):
    # Field 1 carried a UCX address that UCX asserted on (SIGABRT); the server no longer reads
    # one. A member's call with garbage there is answered (a client, secrets) and the shard
    # lives on (every case ends with every process checked).
    raw = b"\x0a\xc8\x01" + os.urandom(200) + b"\x12\x07hostile"
    r = ctx.pb.expert.OpenDataPlaneRequest.FromString(raw)
    reply = ctx.unary(ctx.shard0, "/moe.v1.ExpertService/OpenDataPlane", r,
                      ctx.pb.expert.OpenDataPlaneReply, metadata=ctx.member())
    assert reply.client_id > 0 and len(reply.mac_key) == 32, reply
    return f"OK: client {reply.client_id}, the bytes never reached UCX"


@case("OpenDataPlane: a 1 MiB node name")
def _(ctx):
    r = ctx.pb.expert.OpenDataPlaneRequest()
    r.node = "x" * (1 << 20)
    return expect(C.INVALID_ARGUMENT, "node name of", lambda: ctx.unary(
        ctx.shard0, "/moe.v1.ExpertService/OpenDataPlane", r, ctx.pb.expert.OpenDataPlaneReply,
        metadata=ctx.member()))


@case("GetInfo without the cluster token: no UCX address")
def _(ctx):
    info = ctx.unary(ctx.shard0, "/moe.v1.ExpertService/GetInfo",
                     ctx.pb.expert.GetExpertInfoRequest(), ctx.pb.expert.ExpertServerInfo)
    assert info.ucx_address == b"", "a stranger was handed the shard's UCX worker address"
    return f"OK: data plane {info.data_plane!r}, no address"


@case("Dispatch: partial sums for 2^30 tokens in a 1 KB batch")
def _(ctx):
    # Partial sums are sized by the rows the batch carries, not by num_tokens: served at once.
    before = time.time()
    replies = dispatch_stream(ctx, [batch(ctx, reply_mode=2, num_tokens=1 << 30,
                                          token_index=[0, 1, 2], weights=[0.5, 0.5, 0.5])],
                              metadata=ctx.member())
    took = time.time() - before
    assert replies[0].code == 0 and took < 2, (replies[0].code, replies[0].message, took)
    return f"OK in {1000 * took:.0f} ms, {len(replies[0].outputs.data)} bytes back"


@case("Dispatch: 2^24 row_source entries for 3 rows")
def _(ctx):
    msg = dispatch_error(ctx, batch(ctx, row_source=[0] * (1 << 24)), "INVALID_ARGUMENT",
                         "row_source")
    ok = dispatch_stream(ctx, [batch(ctx)], metadata=ctx.member())  # the next batch is served
    assert ok[0].code == 0, ok[0].message
    return msg


@case("Dispatch: one activations row fed 262,144 times (row_source amplification)")
def _(ctx):
    # The finding: a 1 MB batch, one row of z and 262,144 row_source entries of 0, was computed
    # for 29 s (2.1 GB) and its reply could not be sent, taking the two good batches queued
    # behind it on the stream down. Now refused before compute; the good batches are served.
    bad = batch(ctx, rows=1, batch_id=1)
    bad.groups[0].token_count = 262144
    bad.row_source.extend([0] * 262144)
    before = time.time()
    replies = dispatch_stream(ctx, [bad, batch(ctx, batch_id=2), batch(ctx, batch_id=3)],
                              metadata=ctx.member())
    took = time.time() - before
    replies.sort(key=lambda r: r.batch_id)
    # Refused whole before compute: its reply (256 MiB here) cannot be sent (RESOURCE_EXHAUSTED).
    assert [r.code for r in replies] == [8, 0, 0], [(r.code, r.message) for r in replies]
    assert "the reply would carry" in replies[0].message, replies[0].message
    assert took < 1.0, took
    # Smaller, so that its reply would fit: one row cannot feed one expert twice.
    small = batch(ctx, rows=1, batch_id=4)
    small.groups[0].token_count = 1000
    small.row_source.extend([0] * 1000)
    msg = dispatch_error(ctx, small, "INVALID_ARGUMENT", "appears twice for expert")
    return f"{1000 * took:.0f} ms: {replies[0].message[:60]}...; the next 2 served; {msg[:60]}"


@case("Dispatch: an expert id out of range")
def _(ctx):
    return dispatch_error(ctx, batch(ctx, expert=100000), "INVALID_ARGUMENT", "outside [0, ")


@case("Dispatch: an expert this shard does not host")
def _(ctx):
    hi = ctx.cluster["shard0_hi"]
    return dispatch_error(ctx, batch(ctx, expert=hi), "NOT_FOUND", "is not hosted here")


@case("Dispatch: NaN activations")
def _(ctx):
    v = np.full(3 * ctx.latent, 0.25)
    v[7] = np.nan
    return dispatch_error(ctx, batch(ctx, values=v), "INVALID_ARGUMENT", "finite")


@case("Dispatch: MXFP8 activations with a NaN code")
def _(ctx):
    d = ctx.latent
    codes = bytearray([0x38] * (3 * d))  # 1.0 everywhere ...
    codes[d + 5] = 0xFF  # ... but row 1 column 5 (-NaN)
    r = batch(ctx, precision=2)
    r.activations.CopyFrom(tensor(ctx.pb, bytes(codes) + bytes([127] * (3 * d // 32)), [3, d],
                                  ctx.pb.tensor.DTYPE_MXFP8))
    return dispatch_error(ctx, r, "INVALID_ARGUMENT", "row 1 column 5 is not finite (NaN code)")


@case("Dispatch: an MXFP8 shape claiming 2^30 rows in 1 KB")
def _(ctx):
    r = batch(ctx, precision=2)
    r.activations.CopyFrom(tensor(ctx.pb, bytes(1024), [1 << 30, ctx.latent],
                                  ctx.pb.tensor.DTYPE_MXFP8))
    return dispatch_error(ctx, r, "INVALID_ARGUMENT", "bytes of data but MXFP8")


@case("Dispatch: MXFP8 activations in W4A16")
def _(ctx):
    r = batch(ctx, precision=1)
    r.activations.CopyFrom(tensor(ctx.pb, bytes(3 * ctx.latent * 33 // 32), [3, ctx.latent],
                                  ctx.pb.tensor.DTYPE_MXFP8))
    return dispatch_error(ctx, r, "INVALID_ARGUMENT", "MXFP8 activations need precision W4A8")


@case("Dispatch: an out-of-band header from an unknown client")
def _(ctx):
    r = batch(ctx)
    r.activations.ClearField("data")
    r.out_of_band.client_id = 999
    r.out_of_band.tag = (999 << 40) | 1
    r.out_of_band.activation_bytes = 3 * ctx.latent * 2
    r.out_of_band.reply_tag = (999 << 40) | 1
    r.out_of_band.reply_capacity_bytes = 3 * ctx.latent * 2
    return dispatch_error(ctx, r, "FAILED_PRECONDITION", "unknown data-plane client 999")


@case("Dispatch: timeout_ms = INT64_MAX is served")
def _(ctx):
    replies = dispatch_stream(ctx, [batch(ctx, timeout_ms=(1 << 63) - 1)], metadata=ctx.member())
    assert replies[0].code == 0, (replies[0].code, replies[0].message)
    return "OK (a 24 h budget)"


@case("Dispatch: random bytes on the stream")
def _(ctx):
    # gRPC ends the read side at a message it cannot parse; the stream closes with no reply and
    # the next stream is served.
    replies = dispatch_stream(ctx, [b"\xff\xff\xff\xff", batch(ctx)], metadata=ctx.member())
    assert replies == [], replies
    again = dispatch_stream(ctx, [batch(ctx)], metadata=ctx.member())
    assert again[0].code == 0, again[0].message
    return "stream closed without a reply; the next stream served"


# router-svc: membership, statistics, admin
def register(ctx, name="a-rogue", metadata=None, endpoint="127.0.0.1:1", ranges=None):
    r = ctx.pb.router.RegisterExpertServerRequest()
    r.shard = name
    r.endpoint = endpoint
    for layer, lo, hi in ranges or [(LAYER, 0, 128)]:
        g = r.ranges.add()
        g.layer = layer
        g.expert_lo = lo
        g.expert_hi = hi
    return ctx.unary(ctx.router, "/moe.v1.RouterService/RegisterExpertServer", r,
                     ctx.pb.router.RegisterExpertServerResponse, metadata=metadata)


@case("RegisterExpertServer without the cluster token (a rogue shard)")
def _(ctx):
    before = placement(ctx)
    msg = expect(C.UNAUTHENTICATED, "needs the cluster token", lambda: register(ctx))
    assert placement(ctx) == before, "the placement changed"
    return msg


@case("RegisterExpertServer with a wrong cluster token")
def _(ctx):
    return expect(C.UNAUTHENTICATED, "needs the cluster token", lambda: register(
        ctx, metadata=[("x-moe-cluster-token", ctx.token[:-1] + "x")]))


@case("RegisterExpertServer: a 1 MiB shard name (as a member)")
def _(ctx):
    return expect(C.INVALID_ARGUMENT, "shard name", lambda: register(
        ctx, name="s" * (1 << 20), metadata=ctx.expert_member()))


# Members (the cluster token) are bounded too: what a shard may serve comes from the deployment's
# table (moe-cli up's ranges.json), not from its claim. Each case: the placement unchanged.
@case("member: a new name claiming every expert (the zero-answer rogue)")
def _(ctx):
    # The finding: "a-evil" over [0, 128) with heartbeats made 101 of 101 canary answers wrong.
    # Even with a token minted for that name, the deployment's table gives it nothing.
    before = placement(ctx)
    msg = expect(C.PERMISSION_DENIED, "shard a-evil may serve no experts", lambda: register(
        ctx, name="a-evil", metadata=ctx.expert_member("a-evil")))
    assert placement(ctx) == before, "the placement changed"
    return msg


@case("member: shard-1's token registering shard-0 with shard-0's range (the displacing rogue)")
def _(ctx):
    # The finding: with one token per role, a rogue re-registering shard-0 alternated with the
    # real one in the placement (24 of 28 canary answers wrong). Each expert's token names it.
    before = placement(ctx)
    msgs = [expect(C.PERMISSION_DENIED, "with the member token of shard shard-1", lambda: register(
        ctx, name="shard-0", metadata=ctx.expert_member("shard-1"),
        ranges=[(LAYER, 0, ctx.cluster["shard0_hi"])])) for _ in range(8)]
    assert placement(ctx) == before, "the placement changed"
    return msgs[0]


@case("member: shard-0's own token from a second process while shard-0 lives")
def _(ctx):
    before = placement(ctx)
    msgs = [expect(C.ALREADY_EXISTS, "under a live lease", lambda: register(
        ctx, name="shard-0", metadata=ctx.expert_member("shard-0"),
        ranges=[(LAYER, 0, ctx.cluster["shard0_hi"])])) for _ in range(8)]
    assert placement(ctx) == before, "the placement changed"
    return msgs[0]


@case("member: an expert's token under a name outside the table")
def _(ctx):
    before = placement(ctx)
    msg = expect(C.PERMISSION_DENIED, "with the member token of shard shard-0", lambda: register(
        ctx, name="a-evil", metadata=ctx.expert_member("shard-0")))
    assert placement(ctx) == before, "the placement changed"
    return msg


@case("member: shard-0's name with a superset of its range")
def _(ctx):
    before = placement(ctx)
    msg = expect(C.PERMISSION_DENIED, "may serve experts [0, 64)", lambda: register(
        ctx, name="shard-0", metadata=ctx.expert_member()))
    assert placement(ctx) == before, "the placement changed"
    return msg


@case("member: an expert's token dispatching (acting as an attention node)")
def _(ctx):
    return expect(C.UNAUTHENTICATED, "needs the cluster token of an attention member",
                  lambda: dispatch_stream(ctx, [batch(ctx)], metadata=ctx.expert_member()))


@case("member: an attention node's token registering a shard")
def _(ctx):
    before = placement(ctx)
    msg = expect(C.UNAUTHENTICATED, "needs the cluster token of an expert member",
                 lambda: register(ctx, name="shard-0", metadata=ctx.member(),
                                  ranges=[(LAYER, 0, 64)]))
    assert placement(ctx) == before, "the placement changed"
    return msg


@case("member: 1,024 ranges of 210-character names, 19 times (the 3 GB finding)")
def _(ctx):
    before = placement(ctx)
    msgs = []
    for i in range(19):
        ranges = [(LAYER + j, 0, 64) for j in range(1024)]
        msgs.append(expect(C.INVALID_ARGUMENT, "", lambda: register(
            ctx, name=f"evil-{i}-" + "n" * 200, metadata=ctx.expert_member(), ranges=ranges)))
    msgs.append(expect(C.INVALID_ARGUMENT, "is not managed by this router", lambda: register(
        ctx, name="shard-0", metadata=ctx.expert_member(), ranges=[(LAYER + 1, 0, 64)])))
    msgs.append(expect(C.INVALID_ARGUMENT, "two ranges for layer", lambda: register(
        ctx, name="shard-0", metadata=ctx.expert_member(), ranges=[(LAYER, 0, 32), (LAYER, 32, 64)])))
    assert placement(ctx) == before, "the placement changed"
    return f"{msgs[0]}; {msgs[-2]}; {msgs[-1]}"


@case("Heartbeat on guessed leases without the token")
def _(ctx):
    msgs = []
    for lease in (1, 2, 3, 1 << 40):
        r = ctx.pb.router.HeartbeatRequest()
        r.lease_id = lease
        msgs.append(expect(C.UNAUTHENTICATED, "needs the cluster token", lambda: ctx.unary(
            ctx.router, "/moe.v1.RouterService/Heartbeat", r, ctx.pb.router.HeartbeatResponse)))
    return msgs[0]


def report(ctx, loads, tokens, metadata=None):
    r = ctx.pb.router.ReportStatsRequest()
    r.node = "forger"
    r.layer = LAYER
    r.tokens = tokens
    r.loads.extend(loads)
    return ctx.unary(ctx.router, "/moe.v1.RouterService/ReportStats", r,
                     ctx.pb.router.ReportStatsResponse, metadata=metadata)


@case("ReportStats forged without the token")
def _(ctx):
    before = stats(ctx).total_tokens
    msg = expect(C.UNAUTHENTICATED, "needs the cluster token",
                 lambda: report(ctx, [1 << 40] * 128, 1 << 40))
    after = stats(ctx).total_tokens
    assert after - before < 1 << 30, (before, after)  # only the canary's real traffic
    return msg


@case("ReportStats with loads of 2^63-1 (as a member)")
def _(ctx):
    return expect(C.INVALID_ARGUMENT, "", lambda: report(ctx, [(1 << 63) - 1] * 128, 16 * 4,
                                                          metadata=ctx.member()))


@case("ReportStats with 2^50 tokens (as a member)")
def _(ctx):
    return expect(C.INVALID_ARGUMENT, "", lambda: report(ctx, [0] * 128, 1 << 50,
                                                          metadata=ctx.member()))


def admin(ctx, method, req, resp, token=None):
    md = None if token is None else [("x-moe-admin-token", token)]
    return ctx.unary(ctx.router, f"/moe.v1.RouterService/{method}", req, resp, metadata=md)


@case("Rebalance without the admin token")
def _(ctx):
    r = ctx.pb.router.RebalanceRequest()
    r.layer = LAYER
    return expect(C.PERMISSION_DENIED, "admin token", lambda: admin(
        ctx, "Rebalance", r, ctx.pb.router.RebalanceResponse))


@case("Rebalance with a wrong admin token")
def _(ctx):
    r = ctx.pb.router.RebalanceRequest()
    r.layer = LAYER
    return expect(C.PERMISSION_DENIED, "admin token", lambda: admin(
        ctx, "Rebalance", r, ctx.pb.router.RebalanceResponse, token=ADMIN + "x"))


@case("SetBiasMode without the admin token")
def _(ctx):
    r = ctx.pb.router.SetBiasModeRequest()
    r.layer = LAYER
    r.mode = 2
    return expect(C.PERMISSION_DENIED, "admin token", lambda: admin(
        ctx, "SetBiasMode", r, ctx.pb.router.LayerBias))


@case("RollbackBias without the admin token")
def _(ctx):
    r = ctx.pb.router.RollbackBiasRequest()
    r.layer = LAYER
    return expect(C.PERMISSION_DENIED, "admin token", lambda: admin(
        ctx, "RollbackBias", r, ctx.pb.router.LayerBias))


@case(f"WatchPlacement: {MAX_WATCHERS + 8} streams that never read")
def _(ctx):
    calls = []
    watch = ctx.router.unary_stream("/moe.v1.RouterService/WatchPlacement",
                                    request_serializer=lambda m: m.SerializeToString(),
                                    response_deserializer=ctx.pb.router.Placement.FromString)
    try:
        for _i in range(MAX_WATCHERS + 8):
            calls.append(watch(ctx.pb.router.GetPlacementRequest(), timeout=30))
        refused = 0
        msg = ""
        for c in calls:  # each either streams a placement or was refused
            try:
                next(c)
            except grpc.RpcError as e:
                assert e.code() == C.RESOURCE_EXHAUSTED, (e.code(), e.details())
                refused += 1
                msg = e.details()
        assert refused >= 8, refused
        return f"{refused} RESOURCE_EXHAUSTED: {msg}"
    finally:
        for c in calls:
            c.cancel()
