"""Module paths for `_locate` (private): naming the layer an op ran in.

`module_hooks` keeps the tracer's stack at the running module and its path
and tags the autograd nodes made during each module call with it
(`MODULE_TAG`), for the backward ops `locate_trace` sees.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import types
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from _stablecore.locate import call_site, join
from torchref._src.locate_origins import LOCATE_FILES

MODULE_TAG = "torchref.locate.module"
_TORCH_MODULE_FILE = os.path.join("torch", "nn", "modules", "module.py")


# ----------------------------------------------------------- module paths
def clean(path: str) -> str:
    """A path without the ``_orig_mod`` of `torch.compile`'s wrapper."""
    return ".".join(p for p in path.split(".") if p and p != "_orig_mod")


class _Paths:
    """The path of each module call: the attribute chain written at the call
    site when it resolves (``self.dec(x)``, ``m.head(...)``), else where the
    module sits in the running module (or the model). Inside a call of a
    copy of a module (none in torch but for user code that deep-copies), by
    its type within the running one: the mirror of jaxstable's."""

    def __init__(self, model: torch.nn.Module, tracer: Any) -> None:
        self.stack = tracer.stack
        self.index = {}
        for name, m in model.named_modules():
            self.index.setdefault(id(m), (m, clean(name)))
        self.subs: dict[int, tuple[Any, list]] = {}

    def call_path(self, module, frame) -> str:
        found = call_site(frame, module)
        if found is not None:
            base, parts = found
            at = self.path_of(base)
            if at is not None:
                return clean(join(at, parts))
        return self.path_of(module) or ""

    def path_of(self, obj) -> str | None:
        for entry in reversed(self.stack):
            if entry[0] is obj:
                return entry[1]
        if not isinstance(obj, torch.nn.Module):
            return None
        parent, at = self.stack[-1][:2] if self.stack else (None, "")
        if parent is not None:
            for rel, node in self._subgraph(parent):
                if node is obj:
                    return join(at, [rel])
        known = self.index.get(id(obj))
        if known is not None and known[0] is obj:
            return known[1]
        if parent is None:
            return ""
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
                (clean(n), m)
                for n, m in node.named_modules(remove_duplicate=False)
                if n
            ]
            cached = self.subs[id(node)] = (node, nodes)
        return cached[1]


def _caller(frame) -> Any:
    """The first frame outside ``nn.Module.__call__`` and locate's own files."""
    while frame is not None and (
        frame.f_code.co_filename.endswith(_TORCH_MODULE_FILE)
        or frame.f_code.co_filename in LOCATE_FILES
    ):
        frame = frame.f_back
    return frame


_BASE_NAMES = set(dir(torch.nn.Module))


@contextlib.contextmanager
def module_hooks(model: torch.nn.Module, tracer: Any):
    """Keeps ``tracer.stack`` at the running module and its path (forward
    pre-hooks, and the public methods of the user's own module classes, as
    ``model.encode(x)``), and tags the autograd nodes created during each
    call with its path. ``tracer``: a `locate_trace.Tracer`."""
    paths = _Paths(model, tracer)

    def pre(module, args):
        path = paths.call_path(module, _caller(sys._getframe(1)))
        tracer.stack.append((module, path, torch._C._autograd._get_sequence_nr()))

    def post(module, args, output):
        _, path, seq = tracer.stack.pop()
        _tag_nodes(output, path, seq)

    def wrap(orig):
        @functools.wraps(orig)
        def method(module, *args, **kwargs):
            path = paths.call_path(module, sys._getframe(1))
            seq = torch._C._autograd._get_sequence_nr()
            tracer.stack.append((module, path, seq))
            try:
                out = orig(module, *args, **kwargs)
            finally:
                tracer.stack.pop()
            _tag_nodes(out, path, seq)
            return out

        return method

    handles, patched = [], []
    modules = list(dict.fromkeys(model.modules()))
    for module in modules:
        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post, always_call=True))
    for cls in dict.fromkeys(type(m) for m in modules):
        if cls.__module__.startswith("torch."):
            continue
        for name, fn in list(vars(cls).items()):
            public = not name.startswith("_") and name not in _BASE_NAMES
            if public and isinstance(fn, types.FunctionType):
                setattr(cls, name, wrap(fn))
                patched.append((cls, name, fn))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for cls, name, fn in reversed(patched):
            setattr(cls, name, fn)


def _tag_nodes(output: Any, name: str, seq: int) -> None:
    # Only nodes created during the call (sequence number from its start):
    # the loss code's nodes before the model call stay untagged ("in the
    # loss"). Inner modules finish first and keep their own tag.
    todo = [t.grad_fn for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
    while todo:
        node = todo.pop()
        if node is None or MODULE_TAG in node.metadata or node._sequence_nr() < seq:
            continue
        node.metadata[MODULE_TAG] = name
        todo.extend(n for n, _ in node.next_functions)
