"""Recording what a rank calls on ``torch.distributed``, for the NCCL replay (qn_hf/pipeline/nccl_replay.py).

Inside ``with CallRecorder() as rec:`` every point-to-point operation and collective the code issues
through ``torch.distributed`` is recorded as a ``Call`` (post; and wait, where the code waits for its
work or the call is synchronous), and every ``Tensor.item()`` / ``Tensor.tolist()`` as a host read
(``sync``). The functions are wrapped on the ``torch.distributed`` module for the duration of the
block only; this is test instrumentation, not something the library does. ``CommMeter`` counts bytes
with a dispatch mode instead, but a dispatch mode does not see ``Work.wait()``, which the replay needs.

``batch_isend_irecv`` is recorded as its operations one by one (the pipeline does not batch; ring
attention, which does, is not part of a pipeline trace).
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.distributed as dist

from qn_hf.pipeline.nccl_replay import COLLECTIVE, POST, RECV, SEND, SYNC, WAIT, Call

_P2P = {"isend": SEND, "irecv": RECV, "send": SEND, "recv": RECV}
_ASYNC_P2P = {"isend", "irecv"}
_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
                "reduce_scatter_tensor", "reduce_scatter_single", "reduce", "all_to_all_single", "barrier")


class _RecordedWork:
    """A work whose ``wait`` is recorded; everything else goes to the real one."""

    def __init__(self, work, recorder: CallRecorder, op: int) -> None:
        self._work, self._recorder, self._op = work, recorder, op

    def wait(self, *args, **kwargs):
        self._recorder.calls.append(Call(WAIT, op=self._op))
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


class CallRecorder:
    def __init__(self) -> None:
        self.calls: list[Call] = []
        self._saved: dict[str, object] = {}
        self._next = 0

    def _group(self, bound: inspect.BoundArguments) -> dist.ProcessGroup:
        group = bound.arguments.get("group")
        return group if group is not None else dist.group.WORLD

    def _wrap(self, name: str, fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            group = self._group(bound)
            op, self._next = self._next, self._next + 1
            if name in _P2P:
                key = "dst" if _P2P[name] == SEND else "src"
                peer = bound.arguments.get(key)
                if peer is None:
                    peer = dist.get_global_rank(group, bound.arguments[f"group_{key}"])
                tag = bound.arguments.get("tag", 0)
                call = Call(POST, op=op, group=group.group_name, kind=_P2P[name], peer=peer,
                            label=f"{name} {'to' if _P2P[name] == SEND else 'from'} {peer} tag {tag}")
                asynchronous = name in _ASYNC_P2P
            else:
                members = tuple(dist.get_process_group_ranks(group))
                call = Call(POST, op=op, group=group.group_name, kind=COLLECTIVE, members=members,
                            label=f"{name} over {list(members)}")
                asynchronous = bool(bound.arguments.get("async_op", False))
            self.calls.append(call)
            work = fn(*args, **kwargs)
            if not asynchronous:
                self.calls.append(Call(WAIT, op=op))
                return work
            return _RecordedWork(work, self, op) if work is not None else work

        return wrapper

    def _sync(self, fn):
        @functools.wraps(fn)
        def wrapper(tensor, *args, **kwargs):
            self.calls.append(Call(SYNC, label=f"{fn.__name__}() of a {tuple(tensor.shape)} tensor"))
            return fn(tensor, *args, **kwargs)

        return wrapper

    def __enter__(self) -> CallRecorder:
        for name in (*_P2P, *_COLLECTIVES):
            if hasattr(dist, name):
                self._saved[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, self._saved[name]))
        for name in ("item", "tolist"):
            self._saved[f"Tensor.{name}"] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._sync(self._saved[f"Tensor.{name}"]))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._saved.items():
            if name.startswith("Tensor."):
                setattr(torch.Tensor, name.removeprefix("Tensor."), fn)
            else:
                setattr(dist, name, fn)
        self._saved.clear()
