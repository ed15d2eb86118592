"""What a traced step allocates: live storage bytes under fake (or real) tensors, saved tensors held off the device,
and diffusers' layerwise casting made runnable on fake parameters. The memory plan (memory_plan.py) traces with these.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Iterable, Optional

__all__ = ["HostSaved", "StorageLog", "trace_layerwise_casting"]


class StorageLog:
    """Every storage created while the log is active, and its release: a TorchDispatchMode over any tensors (fake
    or real), entered inside FakeTensorMode so that it sees each op's outputs first.

    A storage is counted once however many views reach it; outputs of ops whose schema says they alias an input
    (views, in-place ops) are not new storage, and storages that existed before (the weights, passed as `known`)
    are never counted. Each storage gets a serial number when it is made (a storage's address is reused once it is
    freed); `peak(exclude)` replays the log leaving out some of them (the gradients, `serials_of`)."""

    def __init__(self, known: Iterable[Any] = (), after_op: Optional[Callable[[], None]] = None,
                 record_ops: bool = False):
        from torch.utils._python_dispatch import TorchDispatchMode

        log = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                # views and in-place ops alias an input: no new storage
                if not any(r.alias_info is not None for r in func._schema.returns):
                    log._saw(out, func)
                if after_op is not None:
                    after_op()
                return out

        self.mode = _Mode()
        self.events: list[tuple[int, int]] = []  # (serial, +bytes at creation / -bytes at release)
        self.known: dict[int, Any] = {}  # address -> weakref; a storage that dies leaves its address to new ones
        for tensor in known:
            storage = tensor.untyped_storage()
            key = storage._cdata
            self.known[key] = weakref.ref(storage, lambda _ref, key=key: self.known.pop(key, None))
        self._alive: dict[int, tuple[int, Any]] = {}  # address -> (serial, weakref) of the storages alive
        self.active = False
        self.ops: Optional[dict[int, str]] = {} if record_ops else None  # serial -> the op that made it

    def _saw(self, out: Any, func: Any = None) -> None:
        import torch
        from torch.utils._pytree import tree_flatten

        for value in tree_flatten(out)[0]:
            if not isinstance(value, torch.Tensor):
                continue
            storage = value.untyped_storage()
            key = storage._cdata
            if key in self._alive or key in self.known:
                continue
            size, serial = storage.nbytes(), len(self.events)
            ref = weakref.ref(storage, lambda _ref, key=key, serial=serial, size=size:
                              self._released(key, serial, size))
            self._alive[key] = (serial, ref)
            self.events.append((serial, size))
            if self.ops is not None:
                self.ops[serial] = str(func)

    def _released(self, key: int, serial: int, size: int) -> None:
        if self._alive.get(key, (None,))[0] == serial:
            del self._alive[key]
        if self.active:
            self.events.append((serial, -size))

    def serials_of(self, tensors: Iterable[Any]) -> set[int]:
        """The serial numbers of the logged storages these tensors live in now."""
        found = set()
        for tensor in tensors:
            entry = self._alive.get(tensor.untyped_storage()._cdata)
            if entry is not None:
                found.add(entry[0])
        return found

    def __enter__(self) -> "StorageLog":
        self.active = True
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.mode.__exit__(*exc)
        self.active = False

    def peak(self, exclude: Iterable[int] = ()) -> int:
        skip, live, top = set(exclude), 0, 0
        for serial, delta in self.events:
            if serial not in skip:
                live += delta
                top = max(top, live)
        return top

    def live_at_peak(self, exclude: Iterable[int] = ()) -> dict[int, int]:
        """{serial: bytes} of the storages alive at the (first) peak."""
        skip, live, top, alive, best = set(exclude), 0, 0, {}, {}
        for serial, delta in self.events:
            if serial in skip:
                continue
            live += delta
            if delta > 0:
                alive[serial] = delta
            else:
                alive.pop(serial, None)
            if live > top:
                top, best = live, dict(alive)
        return best


class HostSaved:
    """`--use_gradient_checkpointing_offload` in a trace: each tensor autograd saves leaves the device (its bytes go to
    `host_bytes`) and comes back as a new tensor of its shape when the backward needs it, as `save_on_cpu` does."""

    def __init__(self) -> None:
        self.host_bytes = 0

    def hooks(self) -> Any:
        import torch

        def pack(tensor: Any) -> Any:
            self.host_bytes += tensor.numel() * tensor.element_size()
            return tensor.shape, tensor.dtype, tensor.stride()

        def unpack(packed: Any) -> Any:
            shape, dtype, stride = packed
            return torch.empty_strided(shape, stride, dtype=dtype)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def trace_layerwise_casting(model: Any) -> int:
    """diffusers' layerwise casting as fake tensors can run it: `module.to(dtype)` cannot swap fake parameters, so
    each casting hook of `model` is pointed at a version that, while its layer runs, puts compute-dtype copies in
    place of the stored (fp8) parameters, as the hook's `.to` does; autograd keeps the copies it saves, as in a
    run. Returns the number of hooks changed."""
    from diffusers.hooks.layerwise_casting import _LAYERWISE_CASTING_HOOK

    def pre_forward(hook: Any, module: Any, *args: Any, **kwargs: Any) -> Any:
        stored = {}
        for name, param in module._parameters.items():
            if param is not None and param.dtype == hook.storage_dtype:
                stored[name] = param
                module._parameters[name] = param.detach().to(hook.compute_dtype)
        module.__dict__["_unitgraph_stored"] = stored
        return args, kwargs

    def post_forward(module: Any, output: Any) -> Any:
        module._parameters.update(module.__dict__.pop("_unitgraph_stored", {}))
        return output

    changed = 0
    for module in model.modules():
        registry = getattr(module, "_diffusers_hook", None)
        hook = registry.get_hook(_LAYERWISE_CASTING_HOOK) if registry is not None else None
        if hook is not None:
            hook.fn_ref.pre_forward = functools.partial(pre_forward, hook)
            hook.fn_ref.post_forward = post_forward
            changed += 1
    return changed
