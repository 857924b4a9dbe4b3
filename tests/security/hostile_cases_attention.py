"""Hostile clients of attention-svc (the catalogue of hostile_clients_test.py): Forward, the
Open Inference Protocol over gRPC, one stream against the rest. Each case registers itself with
hostile_lib.case; the runner imports this module for its side effect."""
import threading
import time

import grpc
import numpy as np

from hostile_lib import (C, CANARY_TOKENS, LAYER, LIMIT, bf16, case, expect, forward,
                         forward_request, http)


# attention-svc: Forward
@case("Forward: dtype unspecified")
def _(ctx):
    return expect(C.INVALID_ARGUMENT, "DTYPE_UNSPECIFIED not accepted",
                  lambda: forward(ctx, forward_request(ctx, dtype=0)))


@case("Forward: a dtype outside the contract")
def _(ctx):
    return expect(C.INVALID_ARGUMENT, "77 (not a dtype of the contract)",
                  lambda: forward(ctx, forward_request(ctx, dtype=77)))


@case("Forward: the shape lies (fewer bytes than it says)")
def _(ctx):
    x = ctx.ref["x"]
    return expect(C.INVALID_ARGUMENT, "bytes of data but shape",
                  lambda: forward(ctx, forward_request(ctx, data=x[:3].tobytes())))


@case("Forward: a shape whose product overflows int64")
def _(ctx):
    return expect(C.INVALID_ARGUMENT, "hidden_states",
                  lambda: forward(ctx, forward_request(ctx, shape=[1 << 62, 1 << 62])))


@case("Forward: a negative dimension")
def _(ctx):
    return expect(C.INVALID_ARGUMENT, "hidden_states",
                  lambda: forward(ctx, forward_request(ctx, shape=[-4, ctx.hidden])))


@case("Forward: rank 3")
def _(ctx):
    return expect(C.INVALID_ARGUMENT, "hidden_states",
                  lambda: forward(ctx, forward_request(ctx, shape=[1, 4, ctx.hidden])))


@case("Forward: the wrong width")
def _(ctx):
    x = np.zeros((4, 100), np.uint16)
    return expect(C.INVALID_ARGUMENT, "width 100 but this layer needs",
                  lambda: forward(ctx, forward_request(ctx, x)))


@case("Forward: zero tokens")
def _(ctx):
    x = np.zeros((0, ctx.hidden), np.uint16)
    return expect(C.INVALID_ARGUMENT, "no rows", lambda: forward(ctx, forward_request(ctx, x)))


@case("Forward: more tokens than --max_tokens")
def _(ctx):
    x = np.zeros((20000, ctx.hidden), np.uint16)
    return expect(C.RESOURCE_EXHAUSTED, "tokens", lambda: forward(ctx, forward_request(ctx, x)))


@case("Forward: NaN in the input")
def _(ctx):
    x = ctx.ref["x"].copy()
    x[2, 5] = 0x7FC0
    return expect(C.INVALID_ARGUMENT, "NaN at token 2, column 5",
                  lambda: forward(ctx, forward_request(ctx, x)))


@case("Forward: Inf in the input")
def _(ctx):
    x = ctx.ref["x"].copy()
    x[1, 0] = 0xFF80
    return expect(C.INVALID_ARGUMENT, "Inf at token 1, column 0",
                  lambda: forward(ctx, forward_request(ctx, x)))


@case("Forward: an expert budget outside [0, k] (dynamic k)")
def _(ctx):
    msgs = []
    for budget in (-1, 9, (1 << 31) - 1):
        r = forward_request(ctx)
        r.options.expert_budget = budget
        msgs.append(expect(C.INVALID_ARGUMENT, "expert_budget", lambda: forward(ctx, r)))
    return msgs[0]


@case("Forward: finite input whose latent overflows")
def _(ctx):
    x = bf16(np.full((2, ctx.hidden), 3.0e38))
    return expect(C.INVALID_ARGUMENT, "latent projection overflows bf16",
                  lambda: forward(ctx, forward_request(ctx, x)))


@case("Forward: a layer this node does not host")
def _(ctx):
    return expect(C.NOT_FOUND, "layer 99 is not hosted here",
                  lambda: forward(ctx, forward_request(ctx, layer=99)))


@case("Forward: a negative layer")
def _(ctx):
    return expect(C.NOT_FOUND, "layer -1 is not hosted here",
                  lambda: forward(ctx, forward_request(ctx, layer=-1)))


@case("Forward: an unknown reply mode")
def _(ctx):
    return expect(C.INVALID_ARGUMENT, "unknown reply_mode 9",
                  lambda: forward(ctx, forward_request(ctx, mode=9)))


@case("Forward: an unknown precision")
def _(ctx):
    r = forward_request(ctx)
    r.options.precision = 9
    return expect(C.INVALID_ARGUMENT, "unknown precision 9", lambda: forward(ctx, r))


@case("Forward: random bytes instead of a message")
def _(ctx):
    return expect(C.INVALID_ARGUMENT, "not a valid moe.v1.ForwardRequest",
                  lambda: forward(ctx, b"\xff\xfe\xfd\xfc\x0f"))


@case("Forward: an empty message")
def _(ctx):
    return expect(C.NOT_FOUND, "layer 0 is not hosted here", lambda: forward(ctx, b""))


@case("Forward: a message over the size limit")
def _(ctx):
    big = b"\x00" * (LIMIT - 4096)  # past attention-svc's 64 MiB default in the test cluster
    return expect(C.RESOURCE_EXHAUSTED, "", lambda: forward(
        ctx, forward_request(ctx, np.zeros((1, ctx.hidden), np.uint16), data=big)))


@case("Forward: a gzip-compressed request (a decompression bomb)")
def _(ctx):
    x = np.zeros((4096, ctx.hidden), np.uint16)  # 8 MiB of zeros: a few KB compressed
    return expect(C.UNIMPLEMENTED, "", lambda: forward(ctx, forward_request(ctx, x),
                                                        compression=grpc.Compression.Gzip))


@case("an unknown method")
def _(ctx):
    return expect(C.UNIMPLEMENTED, "unknown method /moe.v1.AttentionService/Steal",
                  lambda: ctx.unary(ctx.attention, "/moe.v1.AttentionService/Steal", b""))


@case("Forward: a deadline that has passed on arrival")
def _(ctx):
    big = np.tile(ctx.ref["x"], (64, 1))
    return expect(C.DEADLINE_EXCEEDED, "", lambda: forward(ctx, forward_request(ctx, big),
                                                            timeout=0.001))


@case("Forward: F32 input with NaN")
def _(ctx):
    x = np.zeros((2, ctx.hidden), np.float32)
    x[1, 3] = np.nan
    return expect(C.INVALID_ARGUMENT, "NaN at token 1, column 3", lambda: forward(
        ctx, forward_request(ctx, x, dtype=ctx.pb.tensor.DTYPE_F32)))


# attention-svc: the Open Inference Protocol
def model_infer(ctx, model, datatype="BF16", shape=None, raw=None, edit=None):
    inf = ctx.pb.inference
    r = inf.ModelInferRequest()
    r.model_name = model
    t = r.inputs.add()
    t.name = "hidden_states"
    t.datatype = datatype
    t.shape.extend(shape or [CANARY_TOKENS, ctx.hidden])
    r.raw_input_contents.append(ctx.ref["x"].tobytes() if raw is None else raw)
    if edit is not None:
        edit(r)
    return ctx.unary(ctx.attention, "/inference.GRPCInferenceService/ModelInfer", r,
                     inf.ModelInferResponse)


@case("ModelInfer: an unknown model")
def _(ctx):
    return expect(C.NOT_FOUND, "moe-layer-7", lambda: model_infer(ctx, "moe-layer-7"))


@case("ModelInfer: an unsupported datatype")
def _(ctx):
    return expect(C.INVALID_ARGUMENT, "INT8", lambda: model_infer(ctx, f"moe-layer-{LAYER}",
                                                                   datatype="INT8"))


@case("ModelInfer: a shape that does not match the bytes")
def _(ctx):
    return expect(C.INVALID_ARGUMENT, "", lambda: model_infer(
        ctx, f"moe-layer-{LAYER}", shape=[CANARY_TOKENS + 3, ctx.hidden]))


@case("ModelInfer: 10,000 requested outputs named output")
def _(ctx):
    # The finding: answered with 10,000 entries, 9,999 of them empty.
    def edit(r):
        for _ in range(10000):
            r.outputs.add().name = "output"
    return expect(C.INVALID_ARGUMENT, "output 'output' requested twice",
                  lambda: model_infer(ctx, f"moe-layer-{LAYER}", edit=edit))


@case("ModelInfer: 100,000 unknown parameters")
def _(ctx):
    def edit(r):
        for i in range(100000):
            r.parameters[f"p{i}"].string_param = "x"
    return expect(C.INVALID_ARGUMENT, "unknown parameter 'p",
                  lambda: model_infer(ctx, f"moe-layer-{LAYER}", edit=edit))


@case("ModelInfer: one parameter of 48 MiB")
def _(ctx):
    def edit(r):
        r.parameters["blob"].string_param = "x" * (48 << 20)
    msg = expect(C.INVALID_ARGUMENT, "unknown parameter 'blob'",
                 lambda: model_infer(ctx, f"moe-layer-{LAYER}", edit=edit))

    def long_value(r):
        r.parameters["precision"].string_param = "w" * (1 << 20)
    msg2 = expect(C.INVALID_ARGUMENT, "(1048576 bytes)', expected w4a16 or w4a8",
                  lambda: model_infer(ctx, f"moe-layer-{LAYER}", edit=long_value))
    assert len(msg2) < 400, len(msg2)  # the value is not echoed back whole
    return f"{msg}; {msg2}"


@case("ModelInfer: a parameter on a requested output")
def _(ctx):
    def edit(r):
        o = r.outputs.add()
        o.name = "output"
        o.parameters["classification"].int64_param = 3
    return expect(C.INVALID_ARGUMENT, "unknown parameter 'classification' on output 'output'",
                  lambda: model_infer(ctx, f"moe-layer-{LAYER}", edit=edit))


@case("ModelInfer: its refusals are counted in moe_errors_total")
def _(ctx):
    # The finding: 14 ModelInfer errors returned, moe_errors_total{method="ModelInfer"} showed 1.
    def errors():
        _status, body = http(ctx.cluster["attention_metrics"], "GET", "/metrics")
        return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
                   if line.startswith("moe_errors_total{") and 'method="ModelInfer"' in line)
    before = errors()
    for bad in (lambda: model_infer(ctx, "moe-layer-7"),
                lambda: model_infer(ctx, f"moe-layer-{LAYER}", datatype="INT8"),
                lambda: model_infer(ctx, f"moe-layer-{LAYER}", shape=[CANARY_TOKENS + 3, ctx.hidden])):
        try:
            bad()
            raise AssertionError("a bad ModelInfer succeeded")
        except grpc.RpcError:
            pass
    after = errors()
    assert after - before == 3, (before, after)
    return f"3 refused, moe_errors_total{{method=ModelInfer}} {before:.0f} -> {after:.0f}"


@case("ModelInfer: random bytes")
def _(ctx):
    return expect(C.INVALID_ARGUMENT, "not a valid inference.ModelInferRequest",
                  lambda: ctx.unary(ctx.attention, "/inference.GRPCInferenceService/ModelInfer",
                                    b"\xff\xff\xff"))


# attention-svc: one stream against the rest
def forward_stream(ctx):
    return ctx.attention.stream_stream(
        "/moe.v1.AttentionService/ForwardStream",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=ctx.pb.attention.ForwardResponse.FromString)


@case("ForwardStream: 64 large requests at once on one stream")
def _(ctx):
    x = np.tile(ctx.ref["x"], (64, 1))
    reqs = []
    for i in range(64):
        r = forward_request(ctx, x)
        r.request_id = i + 1
        reqs.append(r)
    replies = list(forward_stream(ctx)(iter(reqs), timeout=120))
    refused = [r for r in replies if r.code == C.RESOURCE_EXHAUSTED.value[0]]
    ok = [r for r in replies if r.code == 0]
    assert len(replies) == 64 and refused and ok, (len(replies), len(refused), len(ok))
    assert "already in flight on this stream" in refused[0].message, refused[0].message
    return f"{len(ok)} served, {len(refused)} RESOURCE_EXHAUSTED: {refused[0].message}"


@case("ForwardStream: cancelled with work queued")
def _(ctx):
    x = np.tile(ctx.ref["x"], (64, 1))
    stop = threading.Event()

    def reqs():
        for i in range(16):
            r = forward_request(ctx, x)
            r.request_id = i + 1
            yield r
        stop.wait(10)

    call = forward_stream(ctx)(reqs(), timeout=60)
    time.sleep(0.3)
    call.cancel()
    stop.set()
    return expect(C.CANCELLED, "", lambda: list(call))


@case("ForwardStream: a client that never reads its replies")
def _(ctx):
    x = np.tile(ctx.ref["x"], (256, 1))  # 512 KiB replies
    sent = [0]

    def reqs():
        for i in range(400):  # at most 20 s
            r = forward_request(ctx, x)
            r.request_id = i + 1
            sent[0] += 1
            yield r
            time.sleep(0.05)

    call = forward_stream(ctx)(reqs(), timeout=90)
    time.sleep(15)  # never reads; the server's outbox bound (32 MiB here) must end the stream
    got = 0
    try:
        for _r in call:  # what was written before the cut, then the end of the stream
            got += 1
        raise AssertionError(f"stream not cut off ({got} replies, then OK)")
    except grpc.RpcError as e:
        assert e.code() == C.RESOURCE_EXHAUSTED, (e.code(), e.details())
        assert "does not read its replies" in e.details(), e.details()
        return f"{e.code().name}: {e.details()} ({sent[0]} sent, {got} replies read)"
