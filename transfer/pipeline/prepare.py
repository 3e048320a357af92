"""The prepare stage (its own thread): tasks in schedule order, admitted within the memory
budget, gathered, packed, fused and quantized into staging memory, handed to the write stage.

Every rank of a mesh runs the same gathers in the same order, and every rank enters every
mesh group's barrier. After a failure (its own, or `abort` set by the write stage) the stage
prepares nothing more but still enters the collectives left in the schedule (a drain), so the
other ranks of its meshes do not wait in them until they time out.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Container, Mapping, Sequence
from typing import Any

import torch

from weight_transfer.backends.base import RegionDescriptor, WeightTransferError, WriteOp
from weight_transfer.manifest import torch_dtype
from weight_transfer.pipeline.geometry import block_aligned_parts, ops_for_runs, slices
from weight_transfer.pipeline.graphs import GraphGroups
from weight_transfer.pipeline.quant import QuantFn
from weight_transfer.pipeline.records import TaskRecord
from weight_transfer.pipeline.sources import Shifted, Sources
from weight_transfer.pipeline.staging import Staging
from weight_transfer.pipeline.state import Prepared, RunState
from weight_transfer.planner.types import (
    QuantWrite,
    RankSchedule,
    SliceWrite,
    Task,
    box_shape,
    numel,
    staging_key,
)

GatherFn = Callable[[torch.Tensor], torch.Tensor]
"""full_tensor(param): the whole tensor, a collective over the param's mesh."""
BarrierFn = Callable[[int, int], None]
"""barrier(step, mesh_group): every trainer rank reaches the start of that mesh group of
update `step` (the step is the one the stage runs, never the caller's current one: a stage
thread that outlived its update must not enter a later update's barrier)."""

Fulls = Mapping[str, torch.Tensor | Shifted]
"""A task's sources by name: gathered whole tensors, or this rank's shards in global indices."""


class CollectiveError(WeightTransferError):
    """A gather failed: its collective is broken, so the rank cannot drain the others."""


class PrepareStage:
    """Prepares a schedule's tasks that are neither static nor replayed by an earlier graph."""

    def __init__(
        self,
        *,
        rank: int,
        schedule: RankSchedule,
        sources: Sources,
        descriptors: Mapping[str, Sequence[RegionDescriptor]],
        staging: Staging,
        device: torch.device,
        stream: Any,
        gather: GatherFn,
        barrier: BarrierFn,
        quantize: QuantFn,
        static: Container[int],
        graphs: GraphGroups,
    ) -> None:
        self.rank = rank
        self.schedule = schedule
        self.sources = sources
        self.descriptors = descriptors
        self.staging = staging
        self.device = device
        self.stream = stream
        """torch.cuda.Stream the stage works on (None off CUDA)."""
        self.gather = gather
        self.barrier = barrier
        self.quantize = quantize
        self.static = static
        self.graphs = graphs
        self._gathers_done = 0  # of the task being prepared (what a drain still owes)
        self.doing = ""
        """The collective the stage's thread is in ("" between collectives), for the message
        that refuses an update while a previous one's thread is still running."""
        self.needed = schedule.num_mesh_groups > 1 or any(
            t.task_id not in static and t.task_id not in graphs.skip for t in schedule.tasks
        )
        """Whether an update needs this stage's thread (not when every task is a static batch
        and there are no mesh-group barriers to enter)."""

    def loop(self, st: RunState) -> None:
        """The thread's body: every task in order, handed over through `st.ready`, then None.
        A broken collective ends it: the exception is handed over instead."""
        group = 0
        failed = False
        try:
            for task in self.schedule.tasks:
                if task.task_id in self.static or task.task_id in self.graphs.skip:
                    continue  # posted at the start, or part of an earlier task's graph
                # Every rank enters every group's barrier, also groups it has no task in.
                while group < task.mesh_group:
                    group += 1
                    self._barrier(st.step, group)
                if failed or st.abort.is_set():
                    self._drain(task, 0)
                    continue
                rec = TaskRecord(task.task_id, task.kind, task.nbytes)
                self._gathers_done = 0
                try:
                    if task.task_id in self.graphs:
                        prepared = self.graphs.replay(
                            task,
                            rec,
                            st.t0,
                            st.deadline,
                            st.abort,
                            staging=self.staging,
                            sources=self.sources,
                            stream=self.stream,
                        )
                    else:
                        prepared = self._admit_and_prepare(task, rec, st.t0, st.deadline, st.abort)
                except CollectiveError:
                    raise
                except BaseException as exc:  # the write stage raises it; keep draining
                    st.ready.put(exc)
                    failed = True
                    self._drain(task, self._gathers_done)
                    continue
                if prepared is None:  # aborted while waiting for memory
                    self._drain(task, self._gathers_done)
                    continue
                st.ready.put(prepared)
                # Let the write stage take the GIL now rather than at the next switch
                # interval (5 ms), so writes start as soon as their task is ready.
                time.sleep(0)
            while group < self.schedule.num_mesh_groups - 1:
                group += 1
                self._barrier(st.step, group)
            st.ready.put(None)
        except BaseException as exc:  # a broken collective: handed to the write stage
            st.ready.put(exc)

    def _barrier(self, step: int, group: int) -> None:
        self.doing = f"the barrier of mesh group {group}"
        try:
            self.barrier(step, group)
        finally:
            self.doing = ""

    def _drain(self, task: Task, gathers_done: int) -> None:
        """Enter the collectives of `task` that have not run yet; prepare nothing."""
        if task.kind == "gather":
            for name in task.gather[gathers_done:]:
                self._gather(task, name)

    def _gather(self, task: Task, name: str) -> torch.Tensor:
        """`full_tensor()` of a source (a collective over its mesh)."""
        self.doing = f"gathering {name!r} (task {task.task_id}, mesh group {task.mesh_group})"
        try:
            return self.gather(self.sources.bindings[name].param)
        except Exception as exc:
            # gloo/NCCL name the lost peer only by address; say which collective.
            raise CollectiveError(
                f"trainer rank {self.rank}: gathering {name!r} (task {task.task_id}, "
                f"mesh group {task.mesh_group}) failed; a trainer rank of its mesh is "
                f"lost or timed out: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            self.doing = ""

    def _admit_and_prepare(
        self, task: Task, rec: TaskRecord, t0: float, deadline: float, abort: threading.Event
    ) -> Prepared | None:
        # Admission: scratch within budget (a task alone may use it all), staging from the arena.
        if not self.staging.admit(task, deadline, abort):
            return None
        blocks: list[tuple[int, int]] = []
        try:
            if self.stream is not None:
                # Prepare on its own stream so packing, gathers and quantization overlap the
                # copy engines' writes; the write stage waits on this task's event.
                with torch.cuda.stream(self.stream):
                    return self._prepare(task, rec, t0, deadline, abort, blocks)
            return self._prepare(task, rec, t0, deadline, abort, blocks)
        except BaseException:
            self.staging.free_blocks(blocks)
            self.staging.release_scratch(task.scratch_bytes)
            raise

    def _prepare(
        self,
        task: Task,
        rec: TaskRecord,
        t0: float,
        deadline: float,
        abort: threading.Event,
        blocks: list[tuple[int, int]],
    ) -> Prepared:
        rec.admit = time.perf_counter() - t0
        fulls: dict[str, torch.Tensor | Shifted] = {}
        rec.prepare_start = time.perf_counter() - t0
        if task.kind == "gather":
            for name in task.gather:
                fulls[name] = self._gather(task, name)
                self._gathers_done += 1
        elif task.gather:
            # A quantized unit whose source boxes lie inside this rank's own shards: no
            # collective. The shard starts at its local box, not at the tensor's origin.
            for name in task.gather:
                fulls[name] = self.sources.local_as_global(name)
        ops: dict[str, list[WriteOp]] = defaultdict(list)
        # Engine replicas receive the same bytes: each distinct slice or unit is staged (and
        # quantized) once per task, and every replica's writes read that one copy.
        staged: dict[tuple[object, ...], tuple[int, int]] = {}
        for w in task.writes:
            if isinstance(w, SliceWrite):
                self._prepare_slice(w, fulls, ops, blocks, deadline, abort, staged)
            else:
                self._prepare_quant(w, fulls, ops, blocks, deadline, abort, staged)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
            event.record()
        rec.prepare_end = time.perf_counter() - t0
        del fulls
        return Prepared(task, rec, dict(ops), blocks, task.scratch_bytes, event)

    def _prepare_slice(
        self,
        w: SliceWrite,
        fulls: Fulls,
        ops: dict[str, list[WriteOp]],
        blocks: list[tuple[int, int]],
        deadline: float,
        abort: threading.Event,
        staged: dict[tuple[object, ...], tuple[int, int]],
    ) -> None:
        descs = self.descriptors[w.engine]
        key = staging_key(w)
        if key is not None and key in staged:  # another replica's bytes: already staged
            ops_for_runs(descs, w.runs, self.staging.arena.region, staged[key][0], ops[w.engine])
            return
        if w.source in fulls:
            src = fulls[w.source][slices(w.source_box)]
        else:
            b = self.sources.bindings[w.source]
            local = self.sources.local(w.source)
            assert b.local_box is not None
            origin = [a for a, _ in b.local_box]
            src = local[slices(w.source_box, origin)]
            if w.zero_copy and b.region is not None:
                assert src.is_contiguous() or src.numel() == 1
                base = src.data_ptr() - b.region.address
                ops_for_runs(descs, w.runs, b.region, base, ops[w.engine])
                return
        nbytes = w.nbytes
        arena = self.staging.arena
        off = self.staging.alloc(nbytes, blocks, deadline, abort)
        dst = arena.view(off, nbytes).view(torch_dtype(w.dtype)).view(box_shape(w.source_box))
        dst.copy_(src, non_blocking=True)
        if key is not None:
            staged[key] = (off, 0)
        ops_for_runs(descs, w.runs, arena.region, off, ops[w.engine])

    def _prepare_quant(
        self,
        w: QuantWrite,
        fulls: Fulls,
        ops: dict[str, list[WriteOp]],
        blocks: list[tuple[int, int]],
        deadline: float,
        abort: threading.Event,
        staged: dict[tuple[object, ...], tuple[int, int]],
    ) -> None:
        arena = self.staging.arena
        descs = self.descriptors[w.engine]
        key = staging_key(w)
        assert key is not None
        if key in staged:  # the same unit for another replica: already quantized
            woff, soff = staged[key]
            ops_for_runs(descs, w.weight_runs, arena.region, woff, ops[w.engine])
            ops_for_runs(descs, w.scale_runs, arena.region, soff, ops[w.engine])
            return
        shape = box_shape(w.dest_box)
        origin = [a for a, _ in w.dest_box]
        wbytes = numel(shape)
        sshape = box_shape(w.scale_box)
        sbytes = numel(sshape) * 4
        woff = self.staging.alloc(wbytes, blocks, deadline, abort)
        soff = self.staging.alloc(sbytes, blocks, deadline, abort)
        q = arena.view(woff, wbytes).view(torch.float8_e4m3fn).view(shape)
        s = arena.view(soff, sbytes).view(torch.float32).view(sshape)
        aligned = block_aligned_parts(w, shape, origin)
        if aligned is not None:
            # Every part covers whole quantization blocks: quantize each straight from its
            # source into its rows of the destination, with no high-precision assembly.
            q2 = q.view(shape[-2], shape[-1])
            s2 = s.view(sshape[-2], sshape[-1])
            b0, b1 = w.block
            for a in aligned:
                r0, r1, c0, c1 = a.row0, a.row1, a.col0, a.col1
                src = fulls[a.part.source][slices(a.part.source_box)].reshape(r1 - r0, c1 - c0)
                if src.device != q2.device:
                    src = src.to(q2.device, non_blocking=True)
                self.quantize(
                    src,
                    w.block,
                    q2[r0:r1, c0:c1],
                    s2[r0 // b0 : -(-r1 // b0), c0 // b1 : -(-c1 // b1)],
                )
        else:
            dev = next(iter(fulls.values())).device if fulls else self.device
            hp = torch.empty(shape, dtype=torch.float32, device=dev)
            for p in w.parts:
                part = fulls[p.source][slices(p.source_box)]
                hp[slices(p.dest_box, origin)].copy_(part.reshape(box_shape(p.dest_box)))
            if hp.device != arena.buffer.device:
                hp = hp.to(arena.buffer.device)
            self.quantize(hp, w.block, q, s)
        staged[key] = (woff, soff)
        ops_for_runs(descs, w.weight_runs, arena.region, woff, ops[w.engine])
        ops_for_runs(descs, w.scale_runs, arena.region, soff, ops[w.engine])
