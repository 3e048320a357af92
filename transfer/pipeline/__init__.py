"""The per-rank executor: replays a `RankSchedule` as a pipeline of prepare and write stages.

Stages are FIFO queues of tasks. The prepare stage (its own thread) admits a task only while the
temporary memory of tasks in flight fits the budget, rebuilds gathered tensors with
`full_tensor()` (every rank of a mesh runs the same gathers in the same order), copies, casts,
fuses and quantizes into a fixed, registered staging arena, and hands the task on. Host-to-device
copies of CPU-offloaded shards happen inside that packing copy (on CUDA it is an asynchronous
copy from pinned memory, ordered by a CUDA event rather than a synchronize). The write stage
(the calling thread, which alone drives the transport) waits for a task's event, posts its
writes as one batch per engine, polls completions, and only then returns the task's staging
memory: a source buffer is never reused before its writes completed.

An update is ordered after the caller's current CUDA stream (an event recorded there at the
start: the prepare stream waits on it, and zero-copy posts wait for it), so `update()` right
after an optimizer step needs no synchronize. Writes that repeat every update are handed to the
transport once as prepared batches (`Transport.prepare_writes`), so posting them costs no
per-write work (loopback: one copy-kernel launch over a device table); FP8 graph groups quantize
straight into the engine's memory where the transport maps it on this GPU.

Modules, each readable alone:

- `executor`: `Executor`, which builds the parts below once and runs one update through them.
- `records`: `TaskRecord`, `UpdateStats`, `UpdatePhases`, `trace_events` (what an update reports).
- `sources`: `SourceBinding` and the reallocation checks on the trainer's tensors.
- `staging`: `StagingArena` and `Staging` (scratch admission, arena blocks, graph-group ring).
- `static`: tasks sent straight from registered shards, posted as prepared batches.
- `quant`: the default FP8 quantizer and the table quantizer (one launch per block shape).
- `graphs`: FP8 graph groups: local quantization captured once as CUDA graphs.
- `prepare`: the prepare stage (gathers, packing, quantization, the drain after a failure).
- `write`: the write stage (posting, completion, quiesce and quarantine after a failure).
- `versions`: the version words written at commit.
- `state`, `geometry`: the hand-over types between stages, and shared index arithmetic.
"""

from weight_transfer.pipeline.executor import Executor
from weight_transfer.pipeline.prepare import BarrierFn, GatherFn
from weight_transfer.pipeline.quant import QuantFn, default_quantize
from weight_transfer.pipeline.records import TaskRecord, UpdatePhases, UpdateStats, trace_events
from weight_transfer.pipeline.sources import SourceBinding
from weight_transfer.pipeline.staging import StagingArena

__all__ = [
    "BarrierFn",
    "Executor",
    "GatherFn",
    "QuantFn",
    "SourceBinding",
    "StagingArena",
    "TaskRecord",
    "UpdatePhases",
    "UpdateStats",
    "default_quantize",
    "trace_events",
]
