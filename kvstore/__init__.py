"""The KV block store: a node's block pool and index behind a gRPC control plane and a UCX data plane
(``server``), and what workers use to reach it (``client``, and ``connector``, the engine's side).

Services other than the kvstore import only ``kvstore.client`` and ``kvstore.connector``.
"""
