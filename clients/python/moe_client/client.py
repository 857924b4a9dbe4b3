"""The client: channels to attention-svc (and router-svc for statistics and admin calls)."""
import dataclasses
import glob
import hashlib
import importlib
import os
import queue
import subprocess
import sys
import threading

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
_DEFAULT_PROTO_DIR = os.path.normpath(os.path.join(_HERE, "..", "..", "..", "proto"))
_MAX_MESSAGE = 1 << 30  # gRPC's own default is 4 MB: K3 batches are far larger
_pb = None
_lock = threading.Lock()


class MoeError(RuntimeError):
    """A failed call: .code is the gRPC status name (e.g. "UNAVAILABLE"), .details its message.
    Raised as the subclass of its code (InvalidArgument, NotFound, ...), so callers can catch
    what they handle: `except Unavailable:` retries, `except InvalidArgument:` fixes the input."""

    def __init__(self, code, details):
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


class InvalidArgument(MoeError):
    """The request is wrong (shape, dtype, NaN, an unknown parameter): retrying will not help."""


class NotFound(MoeError):
    """No such layer or model here."""


class ResourceExhausted(MoeError):
    """Over a bound (tokens, message size, the queue): smaller or later."""


class Unavailable(MoeError):
    """An expert shard or the node is down or not ready: retry."""


class DeadlineExceeded(MoeError):
    """The call ran past its deadline (the message names the shard that was late)."""


class PermissionDenied(MoeError):
    """An admin call without the right token, or a member acting as another."""


class Unauthenticated(MoeError):
    """No or a wrong member token."""


_ERRORS = {c.__name__: c for c in (InvalidArgument, NotFound, ResourceExhausted, Unavailable,
                                   DeadlineExceeded, PermissionDenied, Unauthenticated)}


def _error(code, details):
    """The MoeError subclass of a gRPC status name ("INVALID_ARGUMENT" -> InvalidArgument)."""
    cls = _ERRORS.get("".join(w.capitalize() for w in code.split("_")), MoeError)
    return cls(code, details)


def load_protos(proto_dir=None, out_dir=None):
    """Generates (once) and imports the message classes of the wire contract.

    proto_dir: the repository's proto/ (default: next to this package, or $MOE_CLIENT_PROTO_DIR);
    out_dir: where protoc writes (default: $MOE_CLIENT_PROTO_OUT, else ~/.cache/moe_client/<hash>).
    Returns a namespace with .tensor, .attention, .router, .inference modules.
    """
    global _pb
    with _lock:
        if _pb is not None:
            return _pb
        # An installed package (pip install ./clients/python) carries the classes protoc made
        # at build time: nothing is generated at run time.
        bundled = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_proto")
        if proto_dir is None and out_dir is None and os.path.isdir(os.path.join(bundled, "moe")):
            return _import_protos(bundled)
        proto_dir = proto_dir or os.environ.get("MOE_CLIENT_PROTO_DIR", _DEFAULT_PROTO_DIR)
        files = sorted(glob.glob(os.path.join(proto_dir, "moe", "v1", "*.proto")) +
                       glob.glob(os.path.join(proto_dir, "inference", "*.proto")))
        if not files:
            raise FileNotFoundError(f"no .proto files under {proto_dir}")
        digest = hashlib.sha256(b"".join(open(f, "rb").read() for f in files)).hexdigest()[:16]
        out_dir = out_dir or os.environ.get("MOE_CLIENT_PROTO_OUT") or os.path.join(
            os.path.expanduser("~"), ".cache", "moe_client", digest)
        marker = os.path.join(out_dir, ".generated-" + digest)
        if not os.path.exists(marker):
            os.makedirs(out_dir, exist_ok=True)
            subprocess.run(["protoc", f"-I{proto_dir}", f"--python_out={out_dir}"] + files,
                           check=True, timeout=120)
            open(marker, "w").close()
        return _import_protos(out_dir)


def _import_protos(out_dir):
    """Imports the generated modules under out_dir (their own imports name moe.v1.* and
    inference.*, so out_dir goes on sys.path). Called with _lock held."""
    global _pb
    if out_dir not in sys.path:
        sys.path.insert(0, out_dir)
    ns = type("Protos", (), {})()
    ns.tensor = importlib.import_module("moe.v1.tensor_pb2")
    ns.attention = importlib.import_module("moe.v1.attention_pb2")
    ns.router = importlib.import_module("moe.v1.router_pb2")
    ns.inference = importlib.import_module("inference.grpc_inference_pb2")
    ns.source = out_dir
    _pb = ns
    return ns


def f32_to_bf16(x):
    """float32 array -> bf16 bits (uint16), round to nearest even; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >>
               np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded = np.where(nan, ((u >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16),
                           rounded)
    return rounded


def bf16_to_f32(b):
    """bf16 bits (uint16) -> float32, exact."""
    return (np.ascontiguousarray(b, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(
        np.float32)


@dataclasses.dataclass
class Result:
    out_bf16: np.ndarray  # uint16 [T, H]: the layer's bf16 output bits
    expert_ids: np.ndarray = None  # int32 [T, k] when routing was asked for
    weights: np.ndarray = None  # float32 [T, k]
    bias_version: int = 0
    seconds: dict = None
    request_id: int = 0
    precision: str = "w4a16"  # the routed experts' precision that produced out
    dispatch_bytes_sent: int = 0  # activation payload bytes sent to the expert servers
    expert_budget: int = 0  # dynamic k: the budget that produced out (top-k: none)
    routed_pairs: int = 0  # (token, expert) pairs computed; expert_ids has -1 for dropped slots
    routing_mass_kept: float = 1.0  # share of the full top-k routing weight the kept experts carry

    @property
    def out(self):
        """float32 [T, H] (exactly the bf16 values)."""
        return bf16_to_f32(self.out_bf16)


def _unary(channel, method, request, response_cls, timeout, metadata=None):
    import grpc  # noqa: imported here so that `import moe_client` works without grpcio
    call = channel.unary_unary(method, request_serializer=lambda m: m.SerializeToString(),
                               response_deserializer=response_cls.FromString)
    try:
        return call(request, timeout=timeout, metadata=metadata)
    except grpc.RpcError as e:
        raise _error(e.code().name, e.details()) from None


class ForwardStream:
    """Many batches on one AttentionService.ForwardStream; results in any order."""

    def __init__(self, client, timeout):
        import grpc
        self._client = client
        self._pb = client._pb
        self._requests = queue.Queue()
        self._next_id = 1
        call = client._attention.stream_stream(
            "/moe.v1.AttentionService/ForwardStream",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=self._pb.attention.ForwardResponse.FromString)

        def requests():
            while True:
                r = self._requests.get()
                if r is None:
                    return
                yield r

        self._responses = call(requests(), timeout=timeout)
        self._grpc = grpc

    def send(self, x, layer=None, return_routing=False):
        """Queues one batch; returns its request id."""
        req = self._client._forward_request(x, layer, return_routing, None)
        req.request_id = self._next_id
        self._next_id += 1
        self._requests.put(req)
        return req.request_id

    def close(self):
        """No more batches (the results still come)."""
        self._requests.put(None)

    def results(self):
        """Yields (request_id, Result or MoeError) until the server ends the stream."""
        try:
            for r in self._responses:
                if r.code != 0:
                    yield r.request_id, _error(_code_name(r.code), r.message)
                else:
                    yield r.request_id, self._client._result(r)
        except self._grpc.RpcError as e:
            raise _error(e.code().name, e.details()) from None


def _oip_result(blobs, params, routing):
    """A Result from an Open Inference Protocol answer (gRPC or REST): blobs maps each output's
    name to (shape, raw little-endian bytes); params the answer's parameters."""
    shape, raw = blobs["output"]
    res = Result(out_bf16=np.frombuffer(raw, "<u2").reshape(shape).copy(),
                 bias_version=params.get("bias_version", 0),
                 precision=params.get("precision", "w4a16"),
                 expert_budget=params.get("expert_budget", 0),
                 routed_pairs=params.get("routed_pairs", 0),
                 routing_mass_kept=float(params.get("routing_mass_kept", 1.0)))
    if routing:
        shape, raw = blobs["expert_ids"]
        res.expert_ids = np.frombuffer(raw, "<i4").reshape(shape).copy()
        shape, raw = blobs["routing_weights"]
        res.weights = np.frombuffer(raw, "<f4").reshape(shape).copy()
    return res


def _code_name(code):
    import grpc
    for c in grpc.StatusCode:
        if c.value[0] == code:
            return c.name
    return str(code)


def tls_credentials(ca_file, cert_file=None, key_file=None):
    """grpc.ChannelCredentials for a cluster on TLS: the CA its servers' certificates come from,
    and (mutual TLS) this client's certificate and key, all PEM files."""
    import grpc

    def read(path):
        with open(path, "rb") as f:
            return f.read()
    if (cert_file is None) != (key_file is None):
        raise ValueError("a client certificate needs its key and a key its certificate")
    return grpc.ssl_channel_credentials(
        root_certificates=read(ca_file),
        private_key=read(key_file) if key_file else None,
        certificate_chain=read(cert_file) if cert_file else None)


def cluster_args(cluster_json):
    """Client(**cluster_args(path)): the endpoints, the admin token and (mutual TLS, what
    `moe-cli up` makes by default) the credentials of a local cluster's cluster.json."""
    import json
    with open(cluster_json) as f:
        c = json.load(f)
    tls = c.get("tls")
    return {"attention": c["attention"], "router": c.get("router"),
            "admin_token": c.get("admin_token") or None,
            "credentials": tls_credentials(tls["ca_file"], tls["cert_file"], tls["key_file"])
            if tls else None}


class Client:
    """attention: host:port of attention-svc; router: host:port of router-svc (statistics,
    Rebalance); admin_token: the router's admin token for Rebalance; credentials: TLS
    (tls_credentials(...)), else plaintext. A local cluster: Client(**cluster_args(path))."""

    def __init__(self, attention, router=None, admin_token=None, timeout=30.0,
                 max_message_bytes=_MAX_MESSAGE, credentials=None):
        import grpc
        self._pb = load_protos()
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes)]

        def channel(target):
            if credentials is None:
                return grpc.insecure_channel(target, options=options)
            return grpc.secure_channel(target, credentials, options=options)
        self._attention = channel(attention)
        self._router = channel(router) if router else None
        self._admin = [("x-moe-admin-token", admin_token)] if admin_token else None
        self._timeout = timeout
        self._info = None

    def close(self):
        self._attention.close()
        if self._router is not None:
            self._router.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # The model.
    def model_info(self):
        """moe.v1.ModelInfo: hidden, latent, num_experts, top_k, layers, dtypes, modes, shards."""
        self._info = _unary(self._attention, "/moe.v1.AttentionService/GetModelInfo",
                            self._pb.attention.GetModelInfoRequest(), self._pb.attention.ModelInfo,
                            self._timeout)
        return self._info

    def health(self):
        """{"live": bool, "ready": bool} from the Open Inference Protocol endpoints."""
        inf = self._pb.inference
        live = _unary(self._attention, "/inference.GRPCInferenceService/ServerLive",
                      inf.ServerLiveRequest(), inf.ServerLiveResponse, self._timeout).live
        ready = _unary(self._attention, "/inference.GRPCInferenceService/ServerReady",
                       inf.ServerReadyRequest(), inf.ServerReadyResponse, self._timeout).ready
        return {"live": live, "ready": ready}

    # Forward.
    def _forward_request(self, x, layer, return_routing, reply_mode, precision=None,
                         expert_budget=None, expert_top_p=None):
        pb = self._pb
        if layer is None:
            layer = (self._info or self.model_info()).layers[0]
        x = np.asarray(x)
        if x.ndim != 2:
            raise ValueError(f"x must be [T, H], got shape {x.shape}")
        bits = x if x.dtype == np.uint16 else f32_to_bf16(x.astype(np.float32, copy=False))
        req = pb.attention.ForwardRequest(layer=layer)
        t = req.hidden_states
        t.dtype = pb.tensor.DTYPE_BF16
        t.shape.extend(x.shape)
        t.data = np.ascontiguousarray(bits, dtype="<u2").tobytes()
        req.options.return_routing = return_routing
        if reply_mode is not None:
            req.options.reply_mode = {"per_pair": pb.tensor.REPLY_MODE_PER_PAIR,
                                      "partial_sum": pb.tensor.REPLY_MODE_PARTIAL_SUM}[reply_mode]
        if precision is not None:
            modes = {"w4a16": pb.tensor.PRECISION_W4A16, "w4a8": pb.tensor.PRECISION_W4A8}
            if precision not in modes:
                raise ValueError(f"precision must be w4a16 or w4a8, got {precision!r}")
            req.options.precision = modes[precision]
        if expert_budget is not None:
            if not isinstance(expert_budget, int) or expert_budget < 0:
                raise ValueError(f"expert_budget must be an int >= 0, got {expert_budget!r}")
            req.options.expert_budget = expert_budget
        if expert_top_p is not None:
            if not isinstance(expert_top_p, (int, float)) or not 0 <= expert_top_p <= 1:
                raise ValueError(f"expert_top_p must be in [0, 1], got {expert_top_p!r}")
            req.options.expert_top_p = float(expert_top_p)
        return req

    def _result(self, r):
        shape = tuple(r.output.shape)
        out = np.frombuffer(r.output.data, dtype="<u2").reshape(shape).copy()
        res = Result(out_bf16=out, bias_version=r.bias_version, request_id=r.request_id,
                     seconds={f.name: v for f, v in r.seconds.ListFields()},
                     precision="w4a8" if r.precision == self._pb.tensor.PRECISION_W4A8 else "w4a16",
                     dispatch_bytes_sent=r.dispatch_bytes_sent,
                     expert_budget=r.expert_budget, routed_pairs=r.routed_pairs,
                     routing_mass_kept=r.routing_mass_kept)
        if r.routing.top_k:
            k = r.routing.top_k
            res.expert_ids = np.array(r.routing.expert_ids, dtype=np.int32).reshape(-1, k)
            res.weights = np.array(r.routing.weights, dtype=np.float32).reshape(-1, k)
        return res

    def forward(self, x, layer=None, return_routing=False, reply_mode=None, timeout=None,
                precision=None, expert_budget=None, expert_top_p=None):
        """x: float32 [T, H] (rounded to bf16 here, RNE) or uint16 bf16 bits -> Result.

        precision: None (the server's default), "w4a16" or "w4a8" (MXFP8 expert inputs).
        expert_budget: dynamic k, at most this many experts per token on average (None or 0:
        the layer's budget); Result.expert_budget says what was served.
        expert_top_p: dynamic k's second mode instead, each token keeps the experts whose share
        of its routing weight reaches this (Result.routed_pairs, routing_mass_kept say what)."""
        req = self._forward_request(x, layer, return_routing, reply_mode, precision,
                                    expert_budget, expert_top_p)
        r = _unary(self._attention, "/moe.v1.AttentionService/Forward", req,
                   self._pb.attention.ForwardResponse, timeout or self._timeout)
        return self._result(r)

    def infer(self, x, model=None, parameters=None, routing=False, timeout=None):
        """The same call over the Open Inference Protocol (KServe v2 ModelInfer on the same port):
        x float32 [T, H] or uint16 bf16 bits, sent as raw BF16; parameters: the model's
        (precision, reply_mode, expert_budget) -> Result."""
        inf = self._pb.inference
        info = self._info or self.model_info()
        model = model or info.oip_models[0]
        x = np.asarray(x)
        if x.ndim != 2:
            raise ValueError(f"x must be [T, H], got shape {x.shape}")
        bits = x if x.dtype == np.uint16 else f32_to_bf16(x.astype(np.float32, copy=False))
        req = inf.ModelInferRequest(model_name=model)
        t = req.inputs.add(name="hidden_states", datatype="BF16")
        t.shape.extend(x.shape)
        req.raw_input_contents.append(np.ascontiguousarray(bits, dtype="<u2").tobytes())
        names = ["output"] + (["expert_ids", "routing_weights"] if routing else [])
        for n in names:
            req.outputs.add(name=n)
        for k, v in (parameters or {}).items():
            p = req.parameters[k]
            if isinstance(v, bool):
                p.bool_param = v
            elif isinstance(v, int):
                p.int64_param = v
            else:
                p.string_param = str(v)
        r = _unary(self._attention, "/inference.GRPCInferenceService/ModelInfer", req,
                   inf.ModelInferResponse, timeout or self._timeout)
        blobs = {o.name: (tuple(o.shape), raw) for o, raw in zip(r.outputs, r.raw_output_contents)}
        params = {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in r.parameters.items()}
        return _oip_result(blobs, params, routing)

    def stream(self, timeout=None):
        """A ForwardStream (send(), close(), results())."""
        return ForwardStream(self, timeout or self._timeout)

    # router-svc.
    def _need_router(self):
        if self._router is None:
            raise ValueError("this call needs router=host:port")

    def stats(self, layer=None):
        """moe.v1.LoadStats of a layer: loads, window balance, shards, bias history."""
        self._need_router()
        if layer is None:
            layer = (self._info or self.model_info()).layers[0]
        return _unary(self._router, "/moe.v1.RouterService/GetLoadStats",
                      self._pb.router.GetLoadStatsRequest(layer=layer), self._pb.router.LoadStats,
                      self._timeout)

    def set_expert_budget(self, k_avg, layer=None):
        """Dynamic k: the layer's expert budget, 1..top-k (needs admin_token); moe.v1.LayerBias."""
        self._need_router()
        if layer is None:
            layer = (self._info or self.model_info()).layers[0]
        return _unary(self._router, "/moe.v1.RouterService/SetExpertBudget",
                      self._pb.router.SetExpertBudgetRequest(layer=layer, k_avg=k_avg),
                      self._pb.router.LayerBias, self._timeout, metadata=self._admin)

    def rebalance(self, layer=None, dry_run=False):
        """One Quantile Balancing step (needs admin_token); moe.v1.RebalanceResponse."""
        self._need_router()
        if layer is None:
            layer = (self._info or self.model_info()).layers[0]
        return _unary(self._router, "/moe.v1.RouterService/Rebalance",
                      self._pb.router.RebalanceRequest(layer=layer, dry_run=dry_run),
                      self._pb.router.RebalanceResponse, self._timeout, metadata=self._admin)


class AsyncClient:
    """The asyncio form of Client (grpc.aio): the same arguments and the same numpy in and out,
    for an attention engine whose scheduler is a coroutine loop. Many forwards may be in flight
    on one client (asyncio.gather).

        async with AsyncClient("127.0.0.1:50051") as c:
            results = await asyncio.gather(*(c.forward(x) for x in batches))
    """

    def __init__(self, attention, router=None, admin_token=None, timeout=30.0,
                 max_message_bytes=_MAX_MESSAGE, credentials=None):
        import grpc.aio
        # Requests and results are built and read by a synchronous Client's code (no channel
        # of its own is used: the aio channels below carry the calls).
        self._sync = Client.__new__(Client)
        self._sync._pb = load_protos()
        self._sync._info = None
        self._sync._timeout = timeout
        self._pb = self._sync._pb
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes)]

        def channel(target):
            if credentials is None:
                return grpc.aio.insecure_channel(target, options=options)
            return grpc.aio.secure_channel(target, credentials, options=options)
        self._attention = channel(attention)
        self._router = channel(router) if router else None
        self._admin = [("x-moe-admin-token", admin_token)] if admin_token else None
        self._timeout = timeout

    async def close(self):
        await self._attention.close()
        if self._router is not None:
            await self._router.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def _unary(self, channel, method, request, response_cls, timeout=None, metadata=None):
        import grpc
        call = channel.unary_unary(method, request_serializer=lambda m: m.SerializeToString(),
                                   response_deserializer=response_cls.FromString)
        try:
            return await call(request, timeout=timeout or self._timeout, metadata=metadata)
        except grpc.aio.AioRpcError as e:
            raise _error(e.code().name, e.details()) from None

    async def model_info(self):
        """moe.v1.ModelInfo (as Client.model_info)."""
        self._sync._info = await self._unary(
            self._attention, "/moe.v1.AttentionService/GetModelInfo",
            self._pb.attention.GetModelInfoRequest(), self._pb.attention.ModelInfo)
        return self._sync._info

    async def forward(self, x, layer=None, return_routing=False, reply_mode=None, timeout=None,
                      precision=None, expert_budget=None):
        """As Client.forward: x float32 [T, H] or uint16 bf16 bits -> Result."""
        if layer is None and self._sync._info is None:
            await self.model_info()
        req = self._sync._forward_request(x, layer, return_routing, reply_mode, precision,
                                          expert_budget)
        r = await self._unary(self._attention, "/moe.v1.AttentionService/Forward", req,
                              self._pb.attention.ForwardResponse, timeout)
        return self._sync._result(r)

    async def set_expert_budget(self, k_avg, layer=None):
        """As Client.set_expert_budget (needs router= and admin_token=)."""
        if self._router is None:
            raise ValueError("this call needs router=host:port")
        if layer is None:
            layer = (self._sync._info or await self.model_info()).layers[0]
        return await self._unary(self._router, "/moe.v1.RouterService/SetExpertBudget",
                                 self._pb.router.SetExpertBudgetRequest(layer=layer, k_avg=k_avg),
                                 self._pb.router.LayerBias, metadata=self._admin)


class RestClient:
    """The Open Inference Protocol over REST (attention-svc --http_port; cluster.json's
    attention_http), standard library only: inputs go as binary BF16 (the exact bits), the
    output comes back as binary BF16. Errors raise the MoeError subclass of the HTTP status.

        r = RestClient("127.0.0.1:8000").infer(x)   # Result: .out, .out_bf16, .expert_budget
    """

    _BY_STATUS = {400: "INVALID_ARGUMENT", 404: "NOT_FOUND", 429: "RESOURCE_EXHAUSTED",
                  503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}

    def __init__(self, endpoint, timeout=30.0):
        host, port = endpoint.rsplit(":", 1)
        self._host, self._port, self._timeout = host, int(port), timeout

    def _call(self, method, path, body=None, headers=None):
        import http.client
        conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            conn.close()

    def _json(self, method, path):
        import json
        status, _, body = self._call(method, path)
        if status != 200:
            raise _error(self._BY_STATUS.get(status, "UNKNOWN"), body.decode(errors="replace"))
        return json.loads(body)

    def ready(self):
        return self._call("GET", "/v2/health/ready")[0] == 200

    def metadata(self, model=None):
        return self._json("GET", f"/v2/models/{model}" if model else "/v2")

    def models(self):
        """The repository index: [{"name", "version", "state"}]."""
        return self._json("POST", "/v2/repository/index")

    def statistics(self, model=None):
        return self._json("GET", f"/v2/models/{model}/stats" if model else "/v2/models/stats")

    def infer(self, x, model=None, parameters=None, routing=False):
        """x: float32 [T, H] (rounded to bf16 here, RNE) or uint16 bf16 bits -> Result (with the
        routing when asked)."""
        import json
        if model is None:
            model = self.models()[0]["name"]
        x = np.asarray(x)
        if x.ndim != 2:
            raise ValueError(f"x must be [T, H], got shape {x.shape}")
        bits = x if x.dtype == np.uint16 else f32_to_bf16(x.astype(np.float32, copy=False))
        raw = np.ascontiguousarray(bits, dtype="<u2").tobytes()
        outputs = [{"name": "output", "parameters": {"binary_data": True}}]
        if routing:
            outputs += [{"name": n, "parameters": {"binary_data": True}}
                        for n in ("expert_ids", "routing_weights")]
        header = json.dumps({"inputs": [{"name": "hidden_states", "datatype": "BF16",
                                         "shape": list(x.shape),
                                         "parameters": {"binary_data_size": len(raw)}}],
                             "outputs": outputs, "parameters": parameters or {}}).encode()
        status, headers, body = self._call(
            "POST", f"/v2/models/{model}/infer", header + raw,
            {"Inference-Header-Content-Length": str(len(header))})
        if status != 200:
            raise _error(self._BY_STATUS.get(status, "UNKNOWN"), body.decode(errors="replace"))
        n = int(headers["inference-header-content-length"])
        meta = json.loads(body[:n])
        blobs, offset = {}, n
        for o in meta["outputs"]:
            size = o["parameters"]["binary_data_size"]
            blobs[o["name"]] = (tuple(o["shape"]), body[offset:offset + size])
            offset += size
        return _oip_result(blobs, meta["parameters"], routing)
