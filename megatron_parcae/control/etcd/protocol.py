"""etcd's v3 gRPC protocol: its message classes and service stubs, in the fast protobuf backend.

The `etcd3` package ships etcd's generated modules, but they predate protobuf 4 and load
only with the pure-Python backend, which then serves the whole process (TensorBoard's
writer included) and makes every etcd call several times dearer. Their file descriptors
are data: they are read here from those modules' source with `ast` (none of their code
runs), added to a descriptor pool of this module's own, and protobuf and gRPC make the
message classes and stubs from them.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path

import grpc
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.message import Message

PACKAGE = "etcdserverpb"
_FILES = ("kv", "auth", "rpc")  # rpc.proto imports the other two


def _serialized_descriptor(path: Path) -> bytes:
    """The `serialized_pb=` literal of a generated module (a bytes or latin-1 str literal,
    possibly wrapped in a one-argument call such as `_b('...')`)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.keyword) and node.arg == "serialized_pb":
            value = node.value
            if isinstance(value, ast.Call) and len(value.args) == 1:
                value = value.args[0]
            literal = ast.literal_eval(value)
            return literal.encode("latin-1") if isinstance(literal, str) else literal
    raise ImportError(f"{path} holds no serialized_pb= descriptor")


@functools.cache
def _pool() -> descriptor_pool.DescriptorPool:
    spec = importlib.util.find_spec("etcd3")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the etcd3 package is not installed: pip install 'etcd3>=0.12'")
    directory = Path(next(iter(spec.submodule_search_locations))) / "etcdrpc"
    pool = descriptor_pool.DescriptorPool()
    for name in _FILES:
        try:
            pool.AddSerializedFile(_serialized_descriptor(directory / f"{name}_pb2.py"))
        except (OSError, SyntaxError, ValueError, TypeError) as exc:
            raise ImportError(f"cannot read etcd's {name}.proto descriptor from {directory}: {exc}") from exc
    return pool


@functools.cache
def _message_class(full_name: str) -> type[Message]:
    return message_factory.GetMessageClass(_pool().FindMessageTypeByName(full_name))


class _Messages:
    """`rpc.RangeRequest(...)`: etcdserverpb's messages by name."""

    def __getattr__(self, name: str) -> type[Message]:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return _message_class(f"{PACKAGE}.{name}")
        except KeyError:
            raise AttributeError(f"etcd's protocol has no message {PACKAGE}.{name}") from None


rpc = _Messages()


class Stub:
    """A service's methods as gRPC callables on `channel`: `Stub(channel, "KV").Range(request, timeout)`."""

    def __init__(self, channel: grpc.Channel, service: str) -> None:
        descriptor = _pool().FindServiceByName(f"{PACKAGE}.{service}")
        for method in descriptor.methods:
            kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
                    (True, False): channel.stream_unary, (True, True): channel.stream_stream}
            make = kind[(method.client_streaming, method.server_streaming)]
            setattr(self, method.name, make(f"/{descriptor.full_name}/{method.name}",
                                            request_serializer=_message_class(method.input_type.full_name).SerializeToString,
                                            response_deserializer=_message_class(method.output_type.full_name).FromString))
