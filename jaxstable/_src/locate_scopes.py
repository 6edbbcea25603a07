"""Module scopes for `_locate` (private): naming the layer an op ran in.

While `module_scopes` is active, every Flax (NNX, Linen) or Keras module
call runs in a ``jax.named_scope`` marked with `MARK` and naming its path;
`locate_trace` reads it back from each equation's name stack.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from typing import Any

import jax
from jax._src import custom_derivatives, source_info_util

from _stablecore.locate import call_site, join
from jaxstable._src.locate_origins import LIB_MARKERS

MARK = "@jaxstable.module:"  # prefix of the named scope of a module call


# --------------------------------------------------------- module scopes
class module_scopes:
    """While active, every Flax module method call runs in a
    ``jax.named_scope`` naming its path, read back from the equations' name
    stacks; a user's ``custom_vjp`` backward keeps its own source lines.

    NNX: the path of the attribute the call went through (``self.dec(x)``
    is ``dec`` even when ``dec`` is ``enc``), from the outermost module
    called or the object the loss called a submodule on (``m.head(...)`` is
    ``head``), the same names as torch's ``named_modules()``: ``""`` for
    that root, ``decoders.0.conv1`` for a child. Wrapped: ``__call__`` and
    ``attend`` of every `nnx.Module` subclass, and every public method of the
    user's own subclasses (``model.encode(x)``); restored on exit. Inside
    ``nnx.remat``/``nnx.scan`` (copies of the modules), a module is named by
    its type within the running one. Linen: the module's ``path`` joined
    with dots (``"Dense_0"``, ``"blocks_0.lin"``; ``""`` for the root),
    through linen's own method interceptor. Keras 3 (JAX backend): the
    names of the layers called, joined with "/" (``"block/d"``).
    """

    def __enter__(self):
        self.patched: list[tuple[type, str, Any]] = []
        self.stack: list[tuple[Any, str]] = []  # running modules, with paths
        self.index: dict[int, tuple[Any, str]] = {}  # roots' subgraphs
        self.subs: dict[int, tuple[Any, list]] = {}
        self.exits = contextlib.ExitStack()
        self.exits.enter_context(_own_backward_sources())
        self._keras_scopes()
        try:
            from flax import linen, nnx
        except ImportError:  # no flax: plain functions only
            self._module = None
            return self
        self._nnx, self._module = nnx, nnx.Module
        base = set(dir(nnx.Module))
        for cls in _subclasses(nnx.Module):
            user = not cls.__module__.startswith("flax.")
            for name, fn in list(vars(cls).items()):
                if not isinstance(fn, types.FunctionType):
                    continue
                public = not name.startswith("_") and name not in base
                if name == "__call__" or (public and (user or name == "attend")):
                    setattr(cls, name, self._wrap(fn))
                    self.patched.append((cls, name, fn))
        self.exits.enter_context(linen.intercept_methods(_linen_scope))
        return self

    def __exit__(self, *exc):
        for cls, name, fn in reversed(self.patched):
            setattr(cls, name, fn)
        self.exits.close()
        return False

    def _keras_scopes(self) -> None:
        """Keras 3 on the JAX backend, when it is loaded: every layer call
        (``layer(x)``; ``model.stateless_call`` calls its layers so) runs in
        a scope naming the layer names from the outermost one called,
        joined with "/" as Keras joins them in variable paths (``block/d``)."""
        keras = sys.modules.get("keras")
        layer = getattr(keras, "Layer", None)
        if layer is None or keras.backend.backend() != "jax":
            return
        orig, names = layer.__call__, []

        @functools.wraps(orig)
        def call(module, *args, **kwargs):
            names.append(str(getattr(module, "name", type(module).__name__)))
            try:
                with jax.named_scope(MARK + "/".join(names)):
                    return orig(module, *args, **kwargs)
            finally:
                names.pop()

        layer.__call__ = call
        self.patched.append((layer, "__call__", orig))

    def _wrap(self, orig):
        scopes = self

        @functools.wraps(orig)
        def method(module, *args, **kwargs):
            path = scopes.call_path(module, sys._getframe(1))
            scopes.stack.append((module, path))
            try:
                with jax.named_scope(MARK + path):
                    return orig(module, *args, **kwargs)
            finally:
                scopes.stack.pop()

        return method

    def call_path(self, module, frame) -> str:
        """The path of a call of ``module`` made in ``frame``: through the
        attribute chain written at the call site when it resolves."""
        found = call_site(frame, module)
        if found is not None:
            base, parts = found
            at = self.path_of(base)
            if at is not None:
                return join(at, parts)
        return self.path_of(module)

    def path_of(self, obj) -> str | None:
        for o, p in reversed(self.stack):
            if o is obj:
                return p
        if self._module is None or not isinstance(obj, self._module):
            return None
        parent, at = self.stack[-1] if self.stack else (None, "")
        if parent is not None:
            for rel, node in self._subgraph(parent):
                if node is obj:
                    return join(at, [rel])
        known = self.index.get(id(obj))
        if known is not None and known[0] is obj:
            return known[1]
        if parent is None:  # a root: the loss called it
            for rel, node in [("", obj), *self._subgraph(obj)]:
                self.index.setdefault(id(node), (node, rel))
            return ""
        # A copy made by a transform (nnx.remat, nnx.scan): the running
        # module itself, or its submodule of the same type.
        if type(obj) is type(parent):
            return at
        for rel, node in self._subgraph(parent):
            if type(node) is type(obj):
                return join(at, [rel])
        return at

    def _subgraph(self, node) -> list[tuple[str, Any]]:
        cached = self.subs.get(id(node))
        if cached is None or cached[0] is not node:
            nodes = [
                (".".join(str(p) for p in path), n)
                for path, n in self._nnx.iter_graph(node)
                if path and isinstance(n, self._module)
            ]
            cached = self.subs[id(node)] = (node, nodes)
        return cached[1]


def _linen_scope(next_fun, args, kwargs, context):
    if context.method_name == "setup":
        return next_fun(*args, **kwargs)
    path = ".".join(str(p) for p in context.module.path)
    with jax.named_scope(MARK + path):
        return next_fun(*args, **kwargs)


def _subclasses(cls: type) -> list[type]:
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        out.append(c)
        todo.extend(c.__subclasses__())
    return out


@contextlib.contextmanager
def _own_backward_sources():
    """A ``jax.custom_vjp`` backward is traced where JAX replays the forward
    call's traceback; while active, its ops keep the user's own lines."""
    cls = custom_derivatives.custom_vjp
    orig = cls.__call__

    def call(self, *args, **kwargs):
        bwd = self.bwd
        where = getattr(getattr(bwd, "__code__", None), "co_filename", "<")
        if bwd is None or any(m in where for m in LIB_MARKERS):
            return orig(self, *args, **kwargs)

        @functools.wraps(bwd)
        def own(*a):
            # No traceback in the context: each op takes its own (its line
            # in ``bwd``); the name stack (the module) stays.
            ctx = source_info_util._source_info_context
            prev = ctx.context
            ctx.context = source_info_util.SourceInfo(None, prev.name_stack)
            try:
                return bwd(*a)
            finally:
                ctx.context = prev

        self.bwd = own
        try:
            return orig(self, *args, **kwargs)
        finally:
            self.bwd = bwd

    cls.__call__ = call
    try:
        yield
    finally:
        cls.__call__ = orig
