"""The wire: the ``tandem.v1`` protobuf messages and gRPC services (``*.proto``) and their generated
Python modules (``*_pb2*.py``, regenerated with grpcio-tools; never edited by hand).

Nothing of ours is imported here, and the engine never sees these types: services convert at their edges.
"""
