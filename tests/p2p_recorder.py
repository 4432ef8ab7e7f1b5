"""Recording what a rank calls on ``torch.distributed``, for the NCCL replay (qn_hf/pipeline/nccl_replay.py).

Inside ``with CallRecorder() as rec:`` every point-to-point operation and collective the code issues
is recorded as a ``Call`` (post; and wait, where the code waits for its work or the call is
synchronous): the ``torch.distributed`` functions by wrapping them on the module, the functional
collectives (``torch.ops._c10d_functional``: tensor parallelism, sequence parallelism) and their
``wait_tensor`` through a dispatch mode. Host reads of device data are recorded as ``sync``: every
op that reads a tensor's value on the host (``aten._local_scalar_dense``: ``item()``, ``bool(t)``,
``int(t)``) or whose output's shape depends on the values (``nonzero`` and kin), and
``Tensor.tolist()``; ``torch.cuda.synchronize`` as ``device_sync``; the creation of a process group
as ``create`` on its members. This is test instrumentation, not something the library does: the
functions are wrapped for the duration of the block only. ``CommMeter`` counts bytes with a dispatch
mode too, but a dispatch mode does not see ``Work.wait()``, which the replay needs, nor the
``torch.distributed`` functions' groups.

``batch_isend_irecv`` (ring attention's exchange with both neighbours) is recorded as one
collective over its group: NCCL runs a batch on the group's own communicator, all its operations
started together, and every member of a ring takes part in each round; the operations inside are
not recorded again. ``barrier`` blocks the host until it completes (ProcessGroupNCCL's barrier
synchronizes), recorded as a wait and a host read.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode

from qn_hf.pipeline.nccl_replay import COLLECTIVE, CREATE, DEVICE_SYNC, POST, RECV, SEND, SYNC, WAIT, Call
from tests.dist_patches import P2P, Patches

_P2P = {"isend": SEND, "irecv": RECV, "send": SEND, "recv": RECV}
assert set(_P2P) == set(P2P)
_ASYNC_P2P = {"isend", "irecv"}
_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
                "reduce_scatter_tensor", "reduce_scatter_single", "reduce", "all_to_all_single", "barrier",
                "all_gather_object", "broadcast_object_list")


def _always_sync() -> frozenset[str]:
    """The aten ops that make the host wait for the device whatever their arguments (a value read on
    the host, an output whose shape depends on the values): the host-sync counter's list."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "host_syncs.py"
    spec = importlib.util.spec_from_file_location("host_syncs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return frozenset(module.ALWAYS_SYNC)


_HOST_READS = _always_sync()


def _site() -> str:
    """The innermost caller outside torch and this instrumentation: where a host read comes from
    (``qn_hf/...``, ``transformers/...`` or a test's file and line)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename.replace("\\", "/")
        if "/torch/" in path or path.endswith(("p2p_recorder.py", "dist_patches.py")):
            continue
        for root in ("/qn_hf/", "/transformers/", "/tests/"):
            if root in path:
                return f"{root[1:]}{path.split(root, 1)[1]}:{frame.lineno}"
        return f"{path}:{frame.lineno}"
    return "?"


class _RecordedWork:
    """A work whose ``wait`` is recorded; everything else goes to the real one (a batch's works
    share one operation)."""

    def __init__(self, work, recorder: CallRecorder, op: int) -> None:
        self._work, self._recorder, self._op = work, recorder, op

    def wait(self, *args, **kwargs):
        self._recorder.calls.append(Call(WAIT, op=self._op))
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


class _FunctionalCollectives(TorchDispatchMode):
    """Records ``_c10d_functional`` collectives (post) and their ``wait_tensor`` (wait), and host reads."""

    def __init__(self, recorder: CallRecorder) -> None:
        super().__init__()
        self.recorder = recorder
        self.pending: dict[int, tuple[int, torch.Tensor]] = {}  # id(output) -> (op, output kept alive)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace, name = func.namespace, func.__name__.split(".")[0]
        if namespace == "aten" and name in _HOST_READS:
            self.recorder.calls.append(Call(SYNC, label=f"{name} of a {tuple(args[0].shape)} tensor at {_site()}"))
        out = func(*args, **kwargs)
        if namespace == "_c10d_functional" and name == "wait_tensor":
            pending = self.pending.pop(id(args[0]), None)
            if pending is not None:
                self.recorder.calls.append(Call(WAIT, op=pending[0]))
        elif namespace == "_c10d_functional":
            group_name = next(a for a in reversed(args) if isinstance(a, str))
            group = c10d._resolve_process_group(group_name)
            op = self.recorder.post(Call(POST, group=group_name, kind=COLLECTIVE,
                                         members=tuple(dist.get_process_group_ranks(group)),
                                         label=f"functional {name} over {dist.get_process_group_ranks(group)}"))
            for tensor in out if isinstance(out, (list, tuple)) else (out,):
                self.pending[id(tensor)] = (op, tensor)
        return out


class CallRecorder:
    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.host_groups: set[str] = set()  # made with backend="gloo": gloo whatever the world's backend
        self._patches = Patches()
        self._next = 0
        self._batched = 0
        self._mode = _FunctionalCollectives(self)

    def post(self, call: Call) -> int:
        """Append a post with the next operation number; return the number."""
        op, self._next = self._next, self._next + 1
        self.calls.append(Call(call.what, op=op, group=call.group, kind=call.kind, peer=call.peer,
                               members=call.members, label=call.label))
        return op

    def _wrap(self, name: str, fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if self._batched:  # recorded as the batch
                return fn(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            group = bound.arguments.get("group")
            group = group if group is not None else dist.group.WORLD
            if name in _P2P and group.group_name in self.host_groups:  # the hosts' exchange (comm.host_max_)
                return fn(*args, **kwargs)
            if name in _P2P:
                key = "dst" if _P2P[name] == SEND else "src"
                peer = bound.arguments.get(key)
                if peer is None:
                    peer = dist.get_global_rank(group, bound.arguments[f"group_{key}"])
                tag = bound.arguments.get("tag", 0)
                op = self.post(Call(POST, group=group.group_name, kind=_P2P[name], peer=peer,
                                    label=f"{name} {'to' if _P2P[name] == SEND else 'from'} {peer} tag {tag}"))
                asynchronous = name in _ASYNC_P2P
            else:
                members = tuple(dist.get_process_group_ranks(group))
                op = self.post(Call(POST, group=group.group_name, kind=COLLECTIVE, members=members,
                                    label=f"{name} over {list(members)}"))
                asynchronous = bool(bound.arguments.get("async_op", False))
            work = fn(*args, **kwargs)
            if not asynchronous:
                self.calls.append(Call(WAIT, op=op))
                if name == "barrier":
                    self.calls.append(Call(SYNC, label="barrier"))
                return work
            return _RecordedWork(work, self, op) if work is not None else work

        return wrapper

    def _batch(self, fn):
        @functools.wraps(fn)
        def wrapper(p2p_op_list):
            group = p2p_op_list[0].group if p2p_op_list[0].group is not None else dist.group.WORLD
            members = tuple(dist.get_process_group_ranks(group))
            op = self.post(Call(POST, group=group.group_name, kind=COLLECTIVE, members=members,
                                label=f"batch_isend_irecv of {len(p2p_op_list)} over {list(members)}"))
            self._batched += 1
            try:
                works = fn(p2p_op_list)
            finally:
                self._batched -= 1
            return [_RecordedWork(work, self, op) for work in works]

        return wrapper

    def _created(self, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            group = fn(*args, **kwargs)
            if isinstance(group, dist.ProcessGroup) and kwargs.get("backend") == "gloo":
                self.host_groups.add(group.group_name)  # gloo under NCCL too: host transfers, not NCCL's
            if isinstance(group, dist.ProcessGroup):  # not GroupMember.NON_GROUP_MEMBER
                members = tuple(dist.get_process_group_ranks(group))
                self.calls.append(Call(CREATE, group=group.group_name, members=members,
                                       label=f"new_group {list(members)}"))
            return group

        return wrapper

    def _host(self, what: str, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            of = f" of a {tuple(args[0].shape)} tensor" if args and isinstance(args[0], torch.Tensor) else ""
            self.calls.append(Call(what, label=f"{fn.__name__}(){of} at {_site()}"))
            return fn(*args, **kwargs)

        return wrapper

    def __enter__(self) -> CallRecorder:
        for name in _P2P:
            self._patches.replace_dist(name, lambda fn, name=name: self._wrap(name, fn))
        for name in _COLLECTIVES:  # on torch.distributed only: c10d's own calls inside them are not the caller's
            if hasattr(dist, name):
                self._patches.replace(dist, name, self._wrap(name, getattr(dist, name)))
        self._patches.replace_dist("batch_isend_irecv", self._batch)
        self._patches.replace_dist("new_group", self._created)  # c10d's: what new_subgroups_by_enumeration calls
        self._patches.replace(torch.Tensor, "tolist", self._host(SYNC, torch.Tensor.tolist))
        self._patches.replace(torch.cuda, "synchronize", self._host(DEVICE_SYNC, torch.cuda.synchronize))
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)
        self._patches.undo()
