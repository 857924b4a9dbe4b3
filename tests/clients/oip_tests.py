"""The Open Inference Protocol (KServe v2) as standard clients call it, over gRPC (the way
tritonclient does, messages from oip_wire.py) and over REST/JSON, against a running cluster: the
first part of python_client_test.py."""
import json

import grpc
import numpy as np

from cluster_helpers import wait_for
from oip_wire import (LAYER, TOKENS, OPTIONS, attention_pid, decode_infer,
                      expect_code, field, http, infer_request, metric_sum, oip,
                      parse, rss_bytes, shape_of)


# --- the tests -------------------------------------------------------------------------------
def test_open_inference_protocol(endpoint, ref):
    ch = grpc.insecure_channel(endpoint, options=OPTIONS)
    model = f"moe-layer-{LAYER}"
    assert oip(ch, "ServerLive").get(1) == [1]
    wait_for("ServerReady", lambda: oip(ch, "ServerReady").get(1) == [1], 60)
    assert oip(ch, "ModelReady", field(1, model)).get(1) == [1]
    meta = oip(ch, "ServerMetadata")
    assert meta[1][0] == b"stable-latentmoe", meta
    m = oip(ch, "ModelMetadata", field(1, model))
    assert m[1][0].decode() == model and m[2] == [b"1"], m
    inputs = [parse(t) for t in m[4]]
    outputs = {parse(t)[1][0].decode(): parse(t) for t in m[5]}
    assert inputs[0][1][0] == b"hidden_states" and inputs[0][2][0] == b"BF16"
    assert shape_of(inputs[0]) == [-1, 1024], shape_of(inputs[0])
    assert set(outputs) == {"output", "expert_ids", "routing_weights"}, outputs.keys()
    assert shape_of(outputs["expert_ids"]) == [-1, 8], outputs["expert_ids"]  # k
    # Only the published fields of ModelMetadataResponse (1-5): a client that knows only the
    # protocol sees no unknown field.
    assert set(m) <= {1, 2, 3, 4, 5}, sorted(m)

    x, out, ids, w = ref["x"], ref["out"], ref["expert_ids"], ref["weights"]
    # Raw BF16, all outputs (none named).
    r = oip(ch, "ModelInfer", infer_request(model, x[:5]))
    assert r[1][0].decode() == model and r[3][0] == b"req-7"
    got = decode_infer(r)
    assert got["output"][0] == "BF16" and got["output"][1] == [5, 1024]
    assert np.array_equal(got["output"][2], out[:5]), "ModelInfer output != in-process layer"
    assert np.array_equal(got["expert_ids"][2], ids[:5])
    assert np.array_equal(got["routing_weights"][2], w[:5])
    # Response parameters use the protocol's bool, int64 and string fields only (1-3).
    for entry in r.get(4, []):
        value = parse(parse(entry)[2][0])
        assert set(value) <= {1, 2, 3}, (parse(entry)[1], sorted(value))
    # FP32 raw and fp32_contents, output only: the server rounds to bf16 (RNE) first.
    xf = (x[:3].astype(np.uint32) << 16).view(np.float32)
    for raw in (True, False):
        g = decode_infer(oip(ch, "ModelInfer", infer_request(model, xf, "FP32", raw, ["output"])))
        assert list(g) == ["output"] and np.array_equal(g["output"][2], out[:3]), raw
    # partial sums through a request parameter: within the named tolerance of the cluster test
    g = decode_infer(oip(ch, "ModelInfer", infer_request(model, x[:5], outputs=["output"],
                                                          params={"reply_mode": "partial_sum"})))
    assert g["output"][1] == [5, 1024]
    # W4A8 through a request parameter: the in-process C++ layer's W4A8 bits; a bad value refused.
    g = decode_infer(oip(ch, "ModelInfer", infer_request(model, x[:5], outputs=["output"],
                                                          params={"precision": "w4a8"})))
    assert np.array_equal(g["output"][2], ref["out_w4a8"][:5]), "W4A8 ModelInfer differs"
    assert "precision" in expect_code(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: oip(ch, "ModelInfer", infer_request(model, x[:1], params={"precision": "w4a4"})))
    # Dynamic k's cap as an int64 parameter; the response says the budget served and the pairs
    # computed. The layer has no budget solved here: a cap of k is the full top-k (5 x 8 pairs),
    # a cap below k is refused naming the layer, never served at k in silence.
    r = oip(ch, "ModelInfer", infer_request(model, x[:5], params={"expert_budget": 8}))
    rp = dict((parse(e)[1][0].decode(), parse(parse(e)[2][0])) for e in r.get(4, []))
    assert rp["expert_budget"][2] == [8] and rp["routed_pairs"][2] == [40], rp
    assert np.array_equal(decode_infer(r)["output"][2], out[:5])
    assert "has no solved budget thresholds" in expect_code(
        grpc.StatusCode.FAILED_PRECONDITION,
        lambda: oip(ch, "ModelInfer", infer_request(model, x[:5], params={"expert_budget": 2})))
    assert "expert_budget" in expect_code(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: oip(ch, "ModelInfer", infer_request(model, x[:1], params={"expert_budget": "2"})))
    assert "expert_budget" in expect_code(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: oip(ch, "ModelInfer", infer_request(model, x[:1], params={"expert_budget": 9})))
    # The large batch (5.3 MB in, 5.3 MB out).
    big = decode_infer(oip(ch, "ModelInfer", infer_request(model, x, outputs=["output"])))
    assert np.array_equal(big["output"][2], out), "large ModelInfer differs"
    # Refusals, with their codes.
    d = expect_code(grpc.StatusCode.NOT_FOUND,
                    lambda: oip(ch, "ModelInfer", infer_request("moe-layer-99", x[:1])))
    assert "moe-layer-1" in d, d
    expect_code(grpc.StatusCode.NOT_FOUND, lambda: oip(ch, "ModelReady", field(1, "nope")))
    bad = infer_request(model, x[:2, :512])
    assert "1024" in expect_code(grpc.StatusCode.INVALID_ARGUMENT,
                                 lambda: oip(ch, "ModelInfer", bad))
    short = field(1, model) + field(5, field(1, "hidden_states") + field(2, "BF16") +
                                    field(3, [2, 1024])) + field(7, b"\0" * 10)
    assert "raw bytes" in expect_code(grpc.StatusCode.INVALID_ARGUMENT,
                                      lambda: oip(ch, "ModelInfer", short))
    expect_code(grpc.StatusCode.INVALID_ARGUMENT,
                lambda: oip(ch, "ModelInfer", infer_request(model, x[:1], outputs=["logits"])))
    # A compressed request (a small message that could inflate to GBs) is refused before it is
    # inflated: the node's memory does not grow by the inflated size, and it keeps serving.
    pid = attention_pid(endpoint)
    rss0 = rss_bytes(pid)
    zeros = np.zeros((16384, 1024), dtype=np.uint16)  # 32 MiB raw, a few KB gzipped
    call = ch.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    try:
        call(infer_request(model, zeros, outputs=["output"]), timeout=60,
             compression=grpc.Compression.Gzip)
        raise AssertionError("a gzip-compressed request was accepted")
    except grpc.RpcError as e:
        assert e.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INTERNAL), e
        refused = e.code().name
    grown = rss_bytes(pid) - rss0
    assert grown < 16 << 20, f"the node grew by {grown} bytes on a refused compressed request"
    g = decode_infer(oip(ch, "ModelInfer", infer_request(model, x[:5], outputs=["output"])))
    assert np.array_equal(g["output"][2], out[:5])
    print(f"compressed request: {refused}, node memory +{grown >> 20} MiB")
    print("open inference protocol: live, ready, metadata, BF16/FP32/contents, routing, "
          f"{TOKENS} tokens, refusals: ok")


def test_rest(endpoint, attention_metrics, ref):
    """The Open Inference Protocol's REST/JSON front (KServe v2 HTTP) with plain http.client:
    health, metadata, JSON and binary-data inference equal to the in-process layer, the
    statistics and repository extensions, errors with their codes and counted in /metrics."""
    model = f"moe-layer-{LAYER}"
    status, _, body = http(endpoint, "GET", "/v2")
    meta = json.loads(body)
    assert status == 200 and meta["name"] == "stable-latentmoe", meta
    assert {"binary_tensor_data", "statistics", "model_repository"} <= set(meta["extensions"]), meta
    assert http(endpoint, "GET", "/v2/health/live")[0] == 200
    wait_for("REST ready", lambda: http(endpoint, "GET", "/v2/health/ready")[0] == 200, 60)
    assert http(endpoint, "GET", f"/v2/models/{model}/ready")[0] == 200
    status, _, body = http(endpoint, "GET", f"/v2/models/{model}")
    m = json.loads(body)
    assert status == 200 and m["inputs"][0] == {"name": "hidden_states", "datatype": "BF16",
                                                "shape": [-1, 1024]}, m
    assert [o["name"] for o in m["outputs"]] == ["output", "expert_ids", "routing_weights"], m

    x, out, ids, w = ref["x"], ref["out"], ref["expert_ids"], ref["weights"]
    as_f32 = lambda bits: (bits.astype(np.uint32) << 16).view(np.float32)
    # JSON in (FP32 values of the bf16 inputs), JSON out, every output.
    req = {"id": "r1", "inputs": [{"name": "hidden_states", "datatype": "FP32", "shape": [4, 1024],
                                   "data": as_f32(x[:4]).tolist()}]}
    status, headers, body = http(endpoint, "POST", f"/v2/models/{model}/infer",
                                 json.dumps(req), {"Content-Type": "application/json"})
    assert status == 200, body[:300]
    r = json.loads(body)
    assert r["model_name"] == model and r["id"] == "r1" and r["parameters"]["expert_budget"] == 8
    got = {o["name"]: o for o in r["outputs"]}
    assert got["output"]["datatype"] == "BF16" and got["output"]["shape"] == [4, 1024]
    assert np.array_equal(np.array(got["output"]["data"], np.float32), as_f32(out[:4]).ravel()), \
        "REST JSON output != in-process layer"
    assert np.array_equal(np.array(got["expert_ids"]["data"], np.int32), ids[:4].ravel())
    assert np.array_equal(np.array(got["routing_weights"]["data"], np.float32), w[:4].ravel())
    # The binary tensor data extension: raw BF16 in, the output binary out.
    header = json.dumps({"inputs": [{"name": "hidden_states", "datatype": "BF16",
                                     "shape": [16, 1024],
                                     "parameters": {"binary_data_size": 16 * 1024 * 2}}],
                         "outputs": [{"name": "output", "parameters": {"binary_data": True}}]})
    status, headers, body = http(endpoint, "POST", f"/v2/models/{model}/infer",
                                 header.encode() + x[:16].astype("<u2").tobytes(),
                                 {"Inference-Header-Content-Length": str(len(header))})
    assert status == 200, body[:300]
    n = int(headers["inference-header-content-length"])
    r = json.loads(body[:n])
    assert r["outputs"][0]["parameters"]["binary_data_size"] == 16 * 1024 * 2, r
    assert np.array_equal(np.frombuffer(body[n:], "<u2").reshape(16, 1024), out[:16]), \
        "REST binary output != in-process layer"
    # Errors, with their codes; each counted by the node.
    before = metric_sum(attention_metrics, "moe_errors_total", 'method="ModelInfer"')
    bad = [(404, "/v2/models/moe-layer-99/infer", json.dumps(req), "moe-layer-1"),
           (400, f"/v2/models/{model}/infer", "{not json", "not a JSON object"),
           (400, f"/v2/models/{model}/infer",
            json.dumps({**req, "parameters": {"temperature": 1}}), "unknown parameter 'temperature'"),
           (400, f"/v2/models/{model}/infer",
            json.dumps({"inputs": [{**req["inputs"][0], "shape": [4, 512]}]}), "hidden_states")]
    for code, path, payload, text in bad:
        status, _, body = http(endpoint, "POST", path, payload)
        assert status == code and text in json.loads(body)["error"], (code, status, body[:200])
    assert http(endpoint, "GET", "/v1/models")[0] == 404
    after = metric_sum(attention_metrics, "moe_errors_total", 'method="ModelInfer"')
    assert after - before == len(bad), (before, after)
    # The statistics and repository extensions.
    status, _, body = http(endpoint, "GET", f"/v2/models/{model}/stats")
    st = json.loads(body)["model_stats"][0]
    assert status == 200 and st["name"] == model and st["inference_stats"]["success"]["count"] >= 2
    assert st["inference_stats"]["fail"]["count"] >= 2 and st["inference_stats"]["compute_infer"]["ns"] > 0
    status, _, body = http(endpoint, "POST", "/v2/repository/index")
    assert status == 200 and json.loads(body) == [{"name": model, "version": "1", "state": "READY"}]
    print("REST front: metadata, health, JSON and binary inference equal to the in-process layer, "
          f"{len(bad)} errors with their codes (counted), statistics "
          f"({st['inference_stats']['success']['count']} ok), repository index: ok")
