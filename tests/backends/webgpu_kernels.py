"""A test helper (not a test module): which of a WGSL kernel module's ops the webgpu backend
bound during a test."""
from yirage.backends import get_backend_impl


def bound_ops(monkeypatch, ops: dict) -> list[str]:
    """A list that fills with the op of every node the webgpu backend binds to one of ``ops``
    (a kernel module's ``OPS``: {op: (supports, bind)}), through the backend's own choice."""
    impl = get_backend_impl("webgpu")
    bind, bound = impl.bind_library_op, []

    def spy(node, graph, args, out, status=None):
        entry = ops.get(node.op)
        if entry is not None and entry[0](node, graph):
            bound.append(node.op)
        return bind(node, graph, args, out, status)

    monkeypatch.setattr(impl, "bind_library_op", spy)
    return bound
