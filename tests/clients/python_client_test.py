#!/usr/bin/python3
"""Python callers against a real local cluster (Debian's python3-grpcio and python3-numpy).

1. The Open Inference Protocol (KServe v2) the way tritonclient calls it, with its protobuf
   messages encoded and decoded here by hand from the published field numbers (so a wrong
   field number in the server's proto/inference/grpc_inference.proto would fail here) and
   message limits raised: live, ready, server and model metadata, ModelInfer with raw BF16 and
   FP32 inputs (and fp32_contents), the routing outputs, a 2600-token batch (5.3 MB, over gRPC
   Python's 4 MB default), unknown models and bad shapes refused with their codes.
2. The repository's Python client (clients/python): model info, health, forward from float32
   and from bf16 bits, routing, the large batch, the stream with a bad batch in it, stats, and
   Rebalance with and without the admin token.

Part 1 lives in oip_tests.py (with the wire format in oip_wire.py); this file runs both.

The oracle of every output is the in-process C++ layer (`moe-tool forward` on the same
checkpoint and input): with per-pair replies the cluster must equal it bit for bit.
"""
import argparse
import json
import os
import subprocess
import sys

import numpy as np

_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(_TESTS, "common"))
sys.path.insert(0, os.path.join(_TESTS, "reference"))
from cluster_helpers import stop, synth_checkpoint, wait_for  # noqa: E402
from moe_reference import read_safetensors  # noqa: E402
from oip_tests import test_open_inference_protocol, test_rest  # noqa: E402
from oip_wire import LAYER, TOKENS, f32_to_bf16  # noqa: E402

ADMIN = "py-test-token"

def test_torch(client_dir, attention, ckpt, ref):
    """The PyTorch stand-in for the K3 MoE block (moe_client.torch_module, Debian's
    python3-torch): [batch, seq, H] bf16 and fp32 tensors through the service equal the NumPy
    reference computed from the checkpoint's files (the compare test's bounds: at most 1 bf16 ulp
    on at most 1e-3 of the outputs)."""
    import torch
    sys.path.insert(0, client_dir)
    import moe_reference
    from moe_client.torch_module import RemoteMoeBlock
    x_bits = ref["x"][:16]
    want, _, _ = moe_reference.layer_forward(moe_reference.Checkpoint(ckpt), LAYER, x_bits)
    block = RemoteMoeBlock(attention, layer=LAYER)
    assert isinstance(block, torch.nn.Module) and block.hidden_size == 1024
    xt = torch.from_numpy(x_bits.view(np.int16).copy()).view(torch.bfloat16).reshape(2, 8, 1024)
    with torch.no_grad():
        y = block(xt)
        y32 = block(xt.to(torch.float32))
    assert y.shape == (2, 8, 1024) and y.dtype == torch.bfloat16, (y.shape, y.dtype)
    assert y32.dtype == torch.float32 and torch.equal(y32, y.to(torch.float32))
    got = y.reshape(16, 1024).view(torch.int16).numpy().view(np.uint16)
    dist = moe_reference.bf16_ulp_distance(got, want)
    assert dist.max() <= 1 and np.count_nonzero(dist) <= 1e-3 * dist.size, (dist.max(),
                                                                            np.count_nonzero(dist))
    try:
        block(xt.to(torch.float32).requires_grad_())
        raise AssertionError("a tensor that requires grad went through")
    except RuntimeError:
        pass
    block.close()
    print(f"torch: RemoteMoeBlock [2, 8, 1024] bf16 and fp32 equal the NumPy reference "
          f"({np.count_nonzero(dist)} of {dist.size} outputs 1 ulp apart)")


def test_python_client(client_dir, attention, router, ref, work, rest=None):
    sys.path.insert(0, client_dir)
    os.environ["MOE_CLIENT_PROTO_OUT"] = os.path.join(work, "proto-py")
    from moe_client import (Client, InvalidArgument, MoeError, NotFound, RestClient, bf16_to_f32,
                            f32_to_bf16 as to_bf16)
    x_bits, out = ref["x"], ref["out"]
    x = bf16_to_f32(x_bits)
    # The client's bf16 helpers against the test's own (RNE) and back.
    probe = np.random.default_rng(3).standard_normal(10000).astype(np.float32) * 7
    assert np.array_equal(to_bf16(probe), f32_to_bf16(probe))
    assert np.array_equal(bf16_to_f32(to_bf16(x)), x)
    with Client(attention, router=router, admin_token=ADMIN) as c:
        info = c.model_info()
        assert (info.hidden, info.latent, info.num_experts, info.top_k) == (1024, 512, 128, 8)
        assert list(info.layers) == [LAYER] and list(info.oip_models) == [f"moe-layer-{LAYER}"]
        assert info.ready and len(info.shards) == 2 and "w4a16" in info.precision_modes
        assert sorted((s.expert_lo, s.expert_hi) for s in info.shards) == [(0, 64), (64, 128)]
        assert c.health() == {"live": True, "ready": True}
        r = c.forward(x[:7], return_routing=True)
        assert np.array_equal(r.out_bf16, out[:7]) and r.out.dtype == np.float32
        assert np.array_equal(r.expert_ids, ref["expert_ids"][:7])
        assert np.array_equal(r.weights, ref["weights"][:7])
        assert np.array_equal(c.forward(x_bits[:7]).out_bf16, out[:7])  # bf16 bits in
        assert np.array_equal(c.forward(x).out_bf16, out), "large forward differs"
        # W4A8 per request: the in-process layer's W4A8 bits, the mode said, 33/64 of the bytes.
        r8, r16 = c.forward(x, precision="w4a8"), c.forward(x, precision="w4a16")
        assert np.array_equal(r8.out_bf16, ref["out_w4a8"]), "W4A8 forward differs"
        assert (r8.precision, r16.precision) == ("w4a8", "w4a16")
        assert r8.dispatch_bytes_sent * 1024 == r16.dispatch_bytes_sent * 528, (r8, r16)
        assert not np.array_equal(r8.out_bf16, out)
        try:
            c.forward(x[:2], precision="fp8")
            raise AssertionError("a bad precision was accepted")
        except ValueError as e:
            assert "w4a16 or w4a8" in str(e)
        s = c.stream()
        ids = {s.send(x[:3]): out[:3], s.send(x[3:11]): out[3:11]}
        bad = s.send(x[:2], layer=99)
        s.close()
        n = 0
        for rid, res in s.results():
            n += 1
            if rid == bad:
                assert isinstance(res, MoeError) and res.code == "NOT_FOUND", res
            else:
                assert np.array_equal(res.out_bf16, ids[rid])
        assert n == 3
        try:
            c.forward(x[:2, :100])
            raise AssertionError("a bad width went through")
        except MoeError as e:
            assert e.code == "INVALID_ARGUMENT" and "1024" in e.details, e
            assert isinstance(e, InvalidArgument), type(e)  # a typed error of its code
        stats = wait_for("stats", lambda: (lambda st: st if st.total_tokens > 0 else None)(
            c.stats()), 30)
        assert len(stats.total_loads) == 128
        step = c.rebalance(dry_run=True)
        assert step.ByteSize() > 0
        before = c.stats().bias_version
        c.rebalance()  # with the token: applied, a new bias version
        assert c.stats().bias_version == before + 1
        # Dynamic k: the full top-k until a budget is set (thresholds solved from the traffic
        # reported since the new version), then a cap of 2 of 8 per request.
        assert c.forward(x[:4]).expert_budget == 8
        for i in range(20):
            c.forward(x[(8 * i) % 56:(8 * i) % 56 + 8])
        def try_budget():  # refused (FAILED_PRECONDITION) until the reports arrive
            try:
                return c.set_expert_budget(4)
            except MoeError:
                return None
        bias = wait_for("a budget", try_budget, 30)
        assert bias.budget.k_avg == 4 and len(bias.budget.thresholds) == 7 * 128, bias.budget
        r = wait_for("the budget served", lambda: (lambda res: res if res.bias_version ==
                                                   bias.version else None)(c.forward(
                                                       x[:16], return_routing=True,
                                                       expert_budget=2)), 30)
        assert r.expert_budget == 2 and r.routed_pairs == int((r.expert_ids >= 0).sum()), r
        assert r.routed_pairs < 16 * 8 and np.all(r.weights[r.expert_ids < 0] == 0)
        assert 0 < r.routing_mass_kept < 1, r.routing_mass_kept  # experts dropped: weight lost
        # The second mode per request: top-p by routing weight (no thresholds needed).
        tp = c.forward(x[:16], return_routing=True, expert_top_p=0.5)
        assert tp.routed_pairs == int((tp.expert_ids >= 0).sum()) < 16 * 8, tp
        assert tp.routing_mass_kept >= 0.5, tp.routing_mass_kept
        try:
            c.forward(x[:2], expert_top_p=2)
            raise AssertionError("expert_top_p 2 was accepted")
        except ValueError:
            pass
        try:
            c.forward(x[:2], expert_budget=-1)
            raise AssertionError("a negative budget was accepted")
        except ValueError:
            pass
        # Back to the full top-k (what the in-process reference computed) for what follows.
        full = c.set_expert_budget(8)
        wait_for("the full top-k again", lambda: c.forward(x[:1]).bias_version == full.version, 30)
    with Client(attention, router=router) as anonymous:
        try:
            anonymous.rebalance()
            raise AssertionError("Rebalance without the admin token went through")
        except MoeError as e:
            assert e.code in ("PERMISSION_DENIED", "UNAUTHENTICATED"), e
    # asyncio: 8 forwards in flight on one AsyncClient, each equal to the synchronous client's
    # answer (the bias is the rebalanced one now, not the in-process reference's).
    import asyncio
    with Client(attention) as c:
        want = [c.forward(x[8 * i:8 * i + 8]).out_bf16 for i in range(8)]
    from moe_client import AsyncClient

    async def many():
        async with AsyncClient(attention, timeout=60) as ac:
            got = await asyncio.gather(*(ac.forward(x[8 * i:8 * i + 8], expert_budget=0)
                                         for i in range(8)))
            try:
                await ac.forward(x[:2, :100])
                raise AssertionError("a bad width went through asyncio")
            except MoeError as e:
                assert e.code == "INVALID_ARGUMENT", e
            return got
    results = asyncio.run(many())
    for i, res in enumerate(results):
        assert np.array_equal(res.out_bf16, want[i]), f"asyncio batch {i}"
    # The REST form in the package (binary BF16 both ways): the gRPC client's bits and routing.
    rc = RestClient(rest)
    assert rc.ready() and rc.models()[0]["state"] == "READY"
    with Client(attention) as c:
        g = c.forward(x[:8], return_routing=True)
    r = rc.infer(x[:8], routing=True)
    assert np.array_equal(r.out_bf16, g.out_bf16) and np.array_equal(r.expert_ids, g.expert_ids)
    assert np.array_equal(r.weights, g.weights) and r.bias_version == g.bias_version
    # And over the Open Inference Protocol's gRPC form, from the same package.
    with Client(attention) as c:
        o = c.infer(x[:8], routing=True, parameters={"reply_mode": "per_pair"})
    assert np.array_equal(o.out_bf16, g.out_bf16) and np.array_equal(o.expert_ids, g.expert_ids)
    assert np.array_equal(o.weights, g.weights) and o.bias_version == g.bias_version
    for call, cls in ((lambda: rc.infer(x[:2, :100]), InvalidArgument),
                      (lambda: rc.infer(x[:2], model="moe-layer-99"), NotFound)):
        try:
            call()
            raise AssertionError(f"expected {cls.__name__}")
        except cls:
            pass
    print("python client: model info, health, forward (f32, bf16, routing, large), stream, "
          "errors (typed), stats, rebalance, expert budget, asyncio (8 in flight), REST: ok")


def admin_token_file(work, token):
    """The token in a file only this user reads (tokens never go on a command line)."""
    path = os.path.join(work, "admin_token")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return path


def start_cluster(moe_cli, ckpt, cluster_dir, extra=()):
    """moe-cli up on the checkpoint; returns (process, cluster.json contents)."""
    cj = os.path.join(cluster_dir, "cluster.json")
    # A fresh cluster: moe-cli up keeps the router's state in the work dir across runs.
    for stale in (cj, *(os.path.join(cluster_dir, f) for f in ("router.db", "router.db-wal",
                                                                "router.db-shm"))):
        if os.path.exists(stale):
            os.remove(stale)
    up = subprocess.Popen([moe_cli, "up", "--checkpoint", ckpt, "--work_dir", cluster_dir,
                           "--threads", "1", "--max_seconds", "600", *extra],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for("cluster.json", lambda: os.path.exists(cj), 120)
    except AssertionError:
        up.kill()
        raise
    return up, json.load(open(cj))


def assert_refused_without_a_certificate(attention, ca_file, ref):
    """A plaintext client and a TLS client without a certificate of its own are refused at the
    handshake (UNAVAILABLE), not served."""
    from moe_client import Client, MoeError, tls_credentials
    for name, creds in (("plaintext", None), ("no client certificate", tls_credentials(ca_file))):
        with Client(attention, credentials=creds, timeout=5) as c:
            try:
                c.forward(bf16_to_f32_local(ref["x"][:5]))
                raise AssertionError(f"a {name} client was served")
            except MoeError as e:
                assert e.code == "UNAVAILABLE", (name, e)


def test_python_client_tls(client_dir, moe_cli, ckpt, ref, work):
    """The client over mutual TLS (certificates made here by openssl); plaintext and
    certificate-less clients are refused."""
    sys.path.insert(0, client_dir)
    from moe_client import Client, tls_credentials
    pki = os.path.join(work, "pki")
    subprocess.run(["bash", os.path.join(_TESTS, "common", "make_test_pki.sh"), pki], check=True,
                   timeout=60)
    f = {n: os.path.join(pki, n) for n in ("ca.pem", "member.pem", "member.key")}
    up, cluster = start_cluster(moe_cli, ckpt, os.path.join(work, "cluster-tls"), [
        # Each process its own member identity (pki/<name>.pem: spiffe://moe/<role>/<name>).
        f"--tls_ca_file={f['ca.pem']}", f"--tls_cert_file={os.path.join(pki, '{name}.pem')}",
        f"--tls_key_file={os.path.join(pki, '{name}.key')}"])
    try:
        member = tls_credentials(f["ca.pem"], f["member.pem"], f["member.key"])
        with Client(cluster["attention"], credentials=member) as c:
            r = c.forward(bf16_to_f32_local(ref["x"][:5]))
            assert np.array_equal(r.out_bf16, ref["out"][:5]), "TLS forward differs"
        assert_refused_without_a_certificate(cluster["attention"], f["ca.pem"], ref)
    finally:
        stop(up)
    print("python client over mutual TLS: bit-exact; plaintext and certificate-less refused")


def test_python_client_default_tls(client_dir, moe_cli, ckpt, ref, work):
    """moe-cli up with no TLS flags: mutual TLS on a local CA it made (work_dir/pki), one
    identity per process; cluster.json gives a client its certificate (cluster_args), and a
    plaintext or certificate-less client is refused. No plain-HTTP REST front is served."""
    sys.path.insert(0, client_dir)
    from moe_client import Client, cluster_args
    cluster_dir = os.path.join(work, "cluster-default")
    up, cluster = start_cluster(moe_cli, ckpt, cluster_dir)
    try:
        assert cluster.get("tls"), f"moe-cli up's default is not TLS: {cluster}"
        assert cluster["tls"]["ca_file"] == os.path.join(cluster_dir, "pki", "ca.pem"), cluster
        assert cluster["attention_http"].endswith(":0"), "a plain-HTTP REST front on a TLS cluster"
        for name in ("router-svc", "attention-svc", "shard-0", "shard-1", "client"):
            mode = os.stat(os.path.join(cluster_dir, "pki", f"{name}.key")).st_mode & 0o777
            assert mode == 0o600, f"{name}.key mode {oct(mode)}"
        c_args = cluster_args(os.path.join(cluster_dir, "cluster.json"))
        with Client(**c_args) as c:
            r = c.forward(bf16_to_f32_local(ref["x"][:5]))
            assert np.array_equal(r.out_bf16, ref["out"][:5]), "default-TLS forward differs"
        assert_refused_without_a_certificate(cluster["attention"], cluster["tls"]["ca_file"], ref)
    finally:
        stop(up)
    print("moe-cli up's default: mutual TLS on its own CA; its client bit-exact, plaintext and "
          "certificate-less refused")


def bf16_to_f32_local(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--moe-cli", required=True)
    ap.add_argument("--moe-tool", required=True)
    ap.add_argument("--client-dir", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()
    ckpt = synth_checkpoint(args.moe_tool, args.work, "mid", 4)
    ref_path = os.path.join(args.work, "ref.safetensors")
    subprocess.run([args.moe_tool, "forward", "--checkpoint", ckpt, "--tokens", str(TOKENS),
                    "--seed", "9", "--output", ref_path], check=True, stdout=subprocess.DEVNULL,
                   timeout=300)
    ref, _ = read_safetensors(ref_path)
    ref8_path = os.path.join(args.work, "ref-w4a8.safetensors")
    subprocess.run([args.moe_tool, "forward", "--checkpoint", ckpt, "--tokens", str(TOKENS),
                    "--seed", "9", "--precision", "w4a8", "--output", ref8_path], check=True,
                   stdout=subprocess.DEVNULL, timeout=300)
    ref8, _ = read_safetensors(ref8_path)
    assert np.array_equal(ref8["x"], ref["x"])
    ref["out_w4a8"] = ref8["out"]
    # Plaintext, asked for by name: the standard clients below (OIP over gRPC and REST, the REST
    # front itself) speak it; the default (mutual TLS) is tested after.
    up, cluster = start_cluster(args.moe_cli, ckpt, os.path.join(args.work, "cluster"),
                                ["--insecure", "--admin_token_file",
                                 admin_token_file(args.work, ADMIN)])
    try:
        attention, router = cluster["attention"], cluster["router"]
        test_open_inference_protocol(attention, ref)
        test_rest(cluster["attention_http"], cluster["attention_metrics"], ref)
        test_torch(args.client_dir, attention, ckpt, ref)
        test_python_client(args.client_dir, attention, router, ref, args.work,
                           cluster["attention_http"])
    finally:
        stop(up)
    test_python_client_tls(args.client_dir, args.moe_cli, ckpt, ref, args.work)
    test_python_client_default_tls(args.client_dir, args.moe_cli, ckpt, ref, args.work)
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
