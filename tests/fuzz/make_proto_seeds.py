#!/usr/bin/python3
"""Writes seed corpora for the request fuzzers (tests/fuzz/*_fuzz.cc): valid messages and
typical breakages, one directory per target.

Usage: make_proto_seeds.py OUT_DIR   (writes OUT_DIR/{dispatch,forward,qb_histogram,http_query})
The protobuf messages come from the repository's .proto files via the Python client's
load_protos (protoc + Debian python3-protobuf).
"""
import os
import struct
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "clients", "python"))
from moe_client import load_protos  # noqa: E402


def write(out, name, seeds):
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    for i, s in enumerate(seeds):
        with open(os.path.join(d, f"seed-{i}"), "wb") as f:
            f.write(s if isinstance(s, bytes) else s.SerializeToString())


def tensor(pb, rows, cols, dtype=1, elem=2):
    t = pb.tensor.Tensor()
    t.dtype = dtype
    t.shape.extend([rows, cols])
    t.data = bytes(rows * cols * elem)
    return t


def main():
    out = sys.argv[1]
    pb = load_protos(out_dir=os.path.join(out, "protos"))
    import importlib
    expert = importlib.import_module("moe.v1.expert_pb2")
    # DispatchRequest for the fuzzer's shard: layer 1, experts [2, 9) of 16, latent 32.
    seeds = []
    for mode, rows in ((1, 3), (2, 3), (2, 1)):
        r = expert.DispatchRequest()
        r.layer = 1
        r.reply_mode = mode
        g = r.groups.add()
        g.expert_id = 3
        g.token_count = rows
        r.activations.CopyFrom(tensor(pb, rows, 32))
        if mode == 2:
            r.num_tokens = 4
            r.token_index.extend(range(rows))
            r.weights.extend([0.5] * rows)
        seeds.append(r)
    r = expert.DispatchRequest()
    r.CopyFrom(seeds[0])
    r.row_source.extend([0, 0, 0])
    r.activations.CopyFrom(tensor(pb, 1, 32))
    seeds.append(r)
    # W4A8: MXFP8 rows (32 codes + 1 scale each, tensor.proto), and BF16 rows in W4A8.
    r = expert.DispatchRequest()
    r.CopyFrom(seeds[-1])
    r.precision = 2
    r.activations.CopyFrom(tensor(pb, 1, 32, dtype=3, elem=1))
    r.activations.data = bytes(32) + bytes([127])
    seeds.append(r)
    r = expert.DispatchRequest()
    r.CopyFrom(seeds[0])
    r.precision = 2
    seeds.append(r)
    write(out, "dispatch", seeds)
    # ForwardRequest, width 16: bf16 and fp32.
    seeds = []
    for dtype, elem in ((1, 2), (2, 4)):
        r = pb.attention.ForwardRequest()
        r.layer = 1
        r.hidden_states.CopyFrom(tensor(pb, 2, 16, dtype, elem))
        seeds.append(r)
    write(out, "forward", seeds)
    # A QB histogram (numerics/qb.cc Serialize): n = 2 experts, k = 1, 2 bins, 2 tokens.
    def varint(v):
        b = b""
        while True:
            byte = v & 0x7F
            v >>= 7
            b += bytes([byte | (0x80 if v else 0)])
            if not v:
                return b
    h = b"QBH1" + struct.pack("<QQiIII", 1, 0, 1, 2, 1, 2) + struct.pack("<ff", 0.0, 0.0)
    h += varint(2) + varint(1) + varint(1) + varint(1) + varint(1) + varint(2) + varint(0)
    write(out, "qb_histogram", [h])
    # A budget histogram (numerics/dynamic_k.cc Serialize): n = 2, k = 2, k_min 1, 4 bins,
    # 1 token: expert 0 forced, expert 1 free in bin 3 (then a run of zeros in expert 0's bins).
    b = b"BKH1" + struct.pack("<QiIIII", 0, 1, 2, 2, 1, 4)
    b += varint(1) + varint(1) + varint(0)  # tokens, forced[0], forced[1]
    b += varint(0) + varint(7) + varint(1)  # 7 zero bins, then expert 1's last bin
    write(out, "budget_histogram", [b])
    write(out, "http_query", [b"layer=1&to=3", b"a=%20b&flag&x=%zz", b""])


if __name__ == "__main__":
    main()
