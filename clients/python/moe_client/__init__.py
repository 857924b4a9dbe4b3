"""A Python client of the Stable LatentMoE serving stack: numpy in, numpy out.

    import numpy as np
    from moe_client import Client, bf16_to_f32

    with Client("127.0.0.1:50051", router="127.0.0.1:50050") as c:
        info = c.model_info()                      # widths, layers, dtypes, placement
        x = np.random.randn(16, info.hidden).astype(np.float32)
        out = c.forward(x, layer=info.layers[0])   # Result: .out (float32 [T, H]), .expert_ids, ...

Needs grpcio and protobuf (Debian: python3-grpcio, python3-protobuf) and numpy. The message
classes are generated from the repository's .proto files by protoc at first use (or from a
directory given in MOE_CLIENT_PROTO_OUT), so no generated code is checked in.
"""
from .client import (AsyncClient, Client, DeadlineExceeded, ForwardStream, InvalidArgument,
                     MoeError, NotFound, PermissionDenied, ResourceExhausted, RestClient, Result,
                     Unauthenticated, Unavailable, bf16_to_f32, cluster_args, f32_to_bf16,
                     load_protos, tls_credentials)

__all__ = ["AsyncClient", "Client", "DeadlineExceeded", "ForwardStream", "InvalidArgument",
           "MoeError", "NotFound", "PermissionDenied", "ResourceExhausted", "RestClient", "Result",
           "Unauthenticated", "Unavailable", "bf16_to_f32", "cluster_args", "f32_to_bf16",
           "load_protos", "tls_credentials"]
