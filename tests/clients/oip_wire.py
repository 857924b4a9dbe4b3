"""The Open Inference Protocol (KServe v2) on the wire, by hand, for python_client_test.py: its
protobuf messages encoded and decoded from the published field numbers (so a wrong field number
in the server's proto/inference/grpc_inference.proto fails the test), and the small helpers of
the tests (HTTP with http.client, a process's RSS, a metric's sum)."""
import os

import grpc
import numpy as np

LAYER = 1  # the first MoE layer of the mid preset
TOKENS = 2600
LIMIT = 64 << 20
OPTIONS = [("grpc.max_receive_message_length", LIMIT), ("grpc.max_send_message_length", LIMIT)]


# --- protobuf wire format, by hand -----------------------------------------------------------
def varint(n):
    out = bytearray()
    n &= (1 << 64) - 1
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field(num, value):
    """A field: int -> varint, bytes/str -> length-delimited, list of ints -> packed varints."""
    if isinstance(value, bool) or isinstance(value, int):
        return varint(num << 3) + varint(int(value))
    if isinstance(value, str):
        value = value.encode()
    if isinstance(value, list):
        value = b"".join(varint(v) for v in value)
    return varint((num << 3) | 2) + varint(len(value)) + value


def parse(buf):
    """{field number: [values]}: varints as int, length-delimited as bytes."""
    out, i = {}, 0
    while i < len(buf):
        key, i = read_varint(buf, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, i = read_varint(buf, i)
        elif wt == 2:
            n, i = read_varint(buf, i)
            v, i = bytes(buf[i:i + n]), i + n
        elif wt == 1:
            v, i = bytes(buf[i:i + 8]), i + 8
        elif wt == 5:
            v, i = bytes(buf[i:i + 4]), i + 4
        else:
            raise ValueError(f"wire type {wt}")
        out.setdefault(num, []).append(v)
    return out


def read_varint(buf, i):
    shift = result = 0
    while True:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i
        shift += 7


def packed_ints(b):
    vals, i = [], 0
    while i < len(b):
        v, i = read_varint(b, i)
        vals.append(v - (1 << 64) if v >= 1 << 63 else v)
    return vals


def shape_of(fields, num=3):
    out = []
    for v in fields.get(num, []):
        out.extend(packed_ints(v) if isinstance(v, bytes) else [v])
    return out


def oip(channel, method, request=b""):
    call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
    return parse(call(request, timeout=60))


def infer_request(model, x, datatype="BF16", raw=True, outputs=None, params=None):
    # InferInputTensor: name 1, datatype 2, shape 3, contents 5 (fp32_contents 6, packed floats)
    tensor = field(1, "hidden_states") + field(2, datatype) + field(3, list(x.shape))
    req = field(1, model) + field(3, "req-7")
    for k, v in (params or {}).items():  # map<string, InferParameter>: int64 2, string 3
        req += field(4, field(1, k) + field(2, field(2 if isinstance(v, int) else 3, v)))
    if raw:
        payload = x.astype("<u2" if datatype == "BF16" else "<f4").tobytes()
        req += field(5, tensor)
    else:
        contents = field(6, x.astype("<f4").tobytes())
        req += field(5, tensor + field(5, contents))
    for o in outputs or []:
        req += field(6, field(1, o))
    if raw:
        req += field(7, payload)
    return req


def decode_infer(resp):
    outs = {}
    raws = resp.get(6, [])
    for idx, t in enumerate(resp.get(5, [])):
        f = parse(t)
        name, dtype = f[1][0].decode(), f[2][0].decode()
        arr = np.frombuffer(raws[idx], dtype={"BF16": "<u2", "INT32": "<i4", "FP32": "<f4"}[dtype])
        outs[name] = (dtype, shape_of(f), arr.reshape(shape_of(f)))
    return outs


# --- helpers ---------------------------------------------------------------------------------
def f32_to_bf16(x):
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def attention_pid(endpoint):
    """The attention-svc process serving endpoint (its --port_file holds the port)."""
    port = endpoint.rsplit(":", 1)[1]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if not args or not args[0].endswith(b"attention-svc"):
            continue
        for a in args:
            if a.startswith(b"--port_file="):
                try:
                    if open(a.split(b"=", 1)[1]).read().strip() == port:
                        return int(pid)
                except OSError:
                    pass
    raise AssertionError(f"no attention-svc process for {endpoint}")


def rss_bytes(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def expect_code(code, fn):
    try:
        fn()
    except grpc.RpcError as e:
        assert e.code() == code, (e.code(), e.details())
        return e.details()
    raise AssertionError(f"expected {code}")


def http(endpoint, method, path, body=None, headers=None):
    """One request with Python's http.client: (status, headers dict, body bytes)."""
    import http.client
    host, port = endpoint.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request(method, path, body=body, headers=headers or {})
    r = conn.getresponse()
    out = (r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
    conn.close()
    return out


def metric_sum(endpoint, name, label):
    _, _, body = http(endpoint, "GET", "/metrics")
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith(name + "{") and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total
