"""The main job on one machine: real FSDP2 trainer processes update vLLM-layout engine processes.

`run_demo` starts `train_ranks` trainer processes (a `transformers` Llama model sharded with
FSDP2 over gloo, trained with AdamW between updates) and `engine_ranks` engine processes (each
one tensor-parallel rank of a vLLM-layout copy of the model, BF16 or FP8, allocated and filled
with random bytes). Each update is verified: every engine publishes a sha256 of each tensor, and
trainer rank 0 compares them with the reference materialization (`planner.reference`) of the
trainer's full weights. The same functions back the integration tests, which can also ask the
engines to hand their tensors back for `torch.equal`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import socket
from collections.abc import Callable
from typing import Any

import torch

from weight_transfer.config import ReceiverConfig, SenderConfig
from weight_transfer.planner.plan import PlannerConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DemoConfig:
    """What the demo runs."""

    backend: str = "loopback"
    """Transport backend name."""
    fp8: bool = False
    """Engines hold FP8 block-quantized linear weights."""
    replica_fp8: tuple[bool, ...] = ()
    """Several engine replicas, one per entry, each `engine_ranks` tensor-parallel ranks, FP8
    where the entry is True (one schedule feeds BF16 and FP8 replicas at once); empty: one
    replica, FP8 per `fp8`."""
    train_ranks: int = 3
    """Trainer processes (FSDP2 over gloo)."""
    engine_ranks: int = 2
    """Engine processes (tensor-parallel size of the engine)."""
    steps: int = 3
    """Verified updates, with an optimizer step before each."""
    model: str = "tiny"
    """Model shape preset (`planner.presets.models`)."""
    trainer_dtype: str = "bfloat16"
    """Trainer parameter dtype (float32 exercises the cast to the engine's bfloat16)."""
    engine_dtype: str = "bfloat16"
    """Engine parameter dtype (of the non-FP8 tensors)."""
    engine_model: str = "vllm-layout"
    """"vllm-layout": plain tensors in vLLM's per-rank layout; "phi3": a transformers
    Phi3ForCausalLM (fused qkv_proj / gate_up_proj, tp=1) whose logits are compared with the
    trainer's after every update."""
    planner: PlannerConfig = dataclasses.field(
        default_factory=lambda: PlannerConfig(memory_budget_bytes=256 << 20)
    )
    """Planner settings, with the per-rank memory budget (the config file's `[planner]`)."""
    sender: SenderConfig | None = None
    """Trainer settings (the config file's `[sender]`); None: updates may take `timeout_s`."""
    receiver: ReceiverConfig = dataclasses.field(default_factory=ReceiverConfig)
    """Engine settings (the config file's `[receiver]`)."""
    timeout_s: float = 240.0
    """Longest the whole demo may take."""
    return_tensors: bool = False
    """Engines and trainer rank 0 hand tensors back (for tests; costs memory)."""
    seed: int = 0
    """Seed of weights, data and engine fill."""
    transport_options: tuple[tuple[str, str], ...] = ()
    """Backend options (for example UCX transports)."""
    control_host: str = "127.0.0.1"
    """Where trainer rank 0 hosts the control plane (the engines connect there)."""
    trainer_host: str | None = None
    """The trainers' own address (`TransferConfig.listen_host`); None: their route to
    `control_host`. With `engine_host`, trainers and engines act as two hosts."""
    engine_host: str | None = None
    """The engines' own address; None: their route to `control_host`."""
    trainer_transport_options: tuple[tuple[str, str], ...] = ()
    """Backend options of the trainers only, after `transport_options` (e.g. their RDMA
    device)."""
    engine_transport_options: tuple[tuple[str, str], ...] = ()
    """Backend options of the engines only, after `transport_options`."""
    control_port: int = 0
    """Its port; 0 picks a free one."""
    control_token: str = dataclasses.field(default="", repr=False)
    """Shared secret of the control plane; "" makes a fresh random one."""

    def __post_init__(self) -> None:
        if self.train_ranks < 1 or self.engine_ranks < 1 or self.steps < 1:
            raise ValueError("train_ranks, engine_ranks and steps must be >= 1")
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        if self.engine_model not in ("vllm-layout", "phi3"):
            raise ValueError(f"unknown engine_model {self.engine_model!r}")
        if self.engine_model == "phi3" and (
            self.engine_ranks != 1 or self.fp8 or len(self.replica_fp8) > 1
        ):
            raise ValueError("the phi3 engine is one unquantized rank (engine_ranks=1, no fp8)")
        if self.replica_fp8 and self.fp8:
            raise ValueError("give fp8 per replica in replica_fp8, or fp8 for one replica")

    @property
    def replicas(self) -> tuple[bool, ...]:
        """Whether each engine replica is FP8."""
        return self.replica_fp8 or (self.fp8,)

    @property
    def num_engines(self) -> int:
        """Engine processes in all: replicas times tensor-parallel ranks."""
        return len(self.replicas) * self.engine_ranks

    def engine_layout(self, engine: int) -> tuple[int, bool]:
        """(tensor-parallel rank, FP8) of engine process `engine`."""
        return engine % self.engine_ranks, self.replicas[engine // self.engine_ranks]


@dataclasses.dataclass(frozen=True, slots=True)
class UpdateReport:
    """One verified update as trainer rank 0 saw it."""

    step: int
    seconds: float
    nbytes: int
    mismatches: tuple[str, ...]

    @property
    def gbps(self) -> float:
        """Bytes per second / 1e9 (all trainer ranks' bytes over rank 0's update time)."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclasses.dataclass(slots=True)
class DemoResult:
    """Everything the demo observed."""

    updates: list[UpdateReport]
    exit_codes: dict[str, int | None]
    errors: list[str]
    engine_tensors: dict[int, dict[int, dict[str, torch.Tensor]]]
    expected: dict[int, dict[int, dict[str, torch.Tensor]]]
    logits: dict[str, dict[int, torch.Tensor]] = dataclasses.field(default_factory=dict)
    """"engine" / "trainer" -> step -> logits on the probe tokens (phi3 engine only)."""

    @property
    def ok(self) -> bool:
        """True if every process exited 0, every update ran and every tensor matched."""
        return (
            not self.errors
            and all(c == 0 for c in self.exit_codes.values())
            and bool(self.updates)
            and all(not u.mismatches for u in self.updates)
        )


def _pack(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Tensors as (dtype, shape, raw bytes): plain data for the report pipe, so nothing depends
    on the sending process staying alive (torch's shared-memory handles would)."""
    out = {}
    for n, t in tensors.items():
        flat = t.detach().contiguous().cpu().view(-1).view(torch.uint8)
        out[n] = (str(t.dtype).removeprefix("torch."), tuple(t.shape), bytes(flat.numpy()))
    return out


def _unpack(packed: dict[str, tuple[str, tuple[int, ...], bytes]]) -> dict[str, torch.Tensor]:
    out = {}
    for n, (dtype, shape, data) in packed.items():
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out[n] = flat.view(getattr(torch, dtype)).view(shape)
    return out


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model_config(name: str) -> Any:
    from transformers import LlamaConfig

    from weight_transfer.planner.presets.models import get_model_shape

    shape = get_model_shape(name)
    if shape.num_experts:
        raise ValueError(f"the demo trains a dense Llama; {name!r} is a MoE shape")
    return LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        tie_word_embeddings=shape.tie_word_embeddings,
        max_position_embeddings=256,
    )


def transfer_config(cfg: DemoConfig, port: int, token: str, role: str = "trainer") -> Any:
    """The `TransferConfig` a demo process of `role` ("trainer" or "engine") uses (the config
    file's settings, this run's address and token, the role's own address and options)."""
    from weight_transfer.config import ControlPlaneConfig, TransferConfig

    if role not in ("trainer", "engine"):
        raise ValueError(f"role must be 'trainer' or 'engine', got {role!r}")
    trainer = role == "trainer"
    return TransferConfig(
        transport=cfg.backend,
        transport_options=cfg.transport_options
        + (cfg.trainer_transport_options if trainer else cfg.engine_transport_options),
        listen_host=cfg.trainer_host if trainer else cfg.engine_host,
        num_engines=cfg.num_engines,
        control=ControlPlaneConfig(
            host=cfg.control_host, port=port, token=token, timeout_s=cfg.timeout_s
        ),
        sender=cfg.sender or SenderConfig(update_timeout_s=cfg.timeout_s),
        receiver=cfg.receiver,
        planner=cfg.planner,
    )


def preflight(cfg: DemoConfig) -> str | None:
    """Why `cfg` cannot run here, in one line, or None. Checked before any process starts.

    Checks the optional packages the demo needs, the model preset, that the engine's tensor
    parallel size can shard the model as vLLM would, and that the backend can be built here with
    the given options (a missing package or an unknown option is named).
    """
    import importlib.util

    from weight_transfer.backends.base import create_transport
    from weight_transfer.errors import WeightTransferError
    from weight_transfer.planner.presets.models import get_model_shape
    from weight_transfer.planner.presets.vllm import vllm_recipes

    if importlib.util.find_spec("transformers") is None:
        return (
            "the demo trains a transformers Llama, and transformers is not installed: "
            "pip install 'transformers>=4.45'"
        )
    try:
        shape = get_model_shape(cfg.model)
    except ValueError as exc:
        return f"--model: {exc}"
    if shape.num_experts:
        return f"--model {cfg.model!r} is a MoE shape; the demo trains a dense Llama"
    try:
        for fp8 in set(cfg.replicas):
            for r in range(cfg.engine_ranks):
                vllm_recipes(shape, r, cfg.engine_ranks, fp8=fp8)
    except (ValueError, WeightTransferError) as exc:
        return f"--engine-ranks {cfg.engine_ranks}: cannot shard {cfg.model!r}: {exc}"
    if cfg.control_port:
        busy = _port_in_use(cfg.control_host, cfg.control_port)
        if busy is not None:
            return (
                f"control port {cfg.control_port} on {cfg.control_host} is in use ({busy}): "
                "give another ([control] port) or leave it out for a free one"
            )
    try:
        token = cfg.control_token or secrets.token_hex(16)
        for role in ("trainer", "engine"):
            config = transfer_config(cfg, cfg.control_port or 1, token, role)
            create_transport(config.transport_config()).close()
    except (ValueError, WeightTransferError, OSError) as exc:
        return f"--backend {cfg.backend}: {str(exc).splitlines()[0]}"
    return None


def _port_in_use(host: str, port: int) -> str | None:
    """Why trainer rank 0 could not host the control plane at host:port, or None.

    A test bind, as the store's own listen would (without SO_REUSEPORT): the demo refuses a busy
    port before it starts any process, rather than failing rank 0 once every process started.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"cannot resolve {host!r}: {exc}"
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def probe_tokens(cfg: DemoConfig) -> torch.Tensor:
    """Fixed random tokens on which engine and trainer logits are compared."""
    from weight_transfer.planner.presets.models import get_model_shape

    g = torch.Generator().manual_seed(cfg.seed + 99)
    return torch.randint(0, get_model_shape(cfg.model).vocab_size, (2, 24), generator=g)


def _phi3(cfg: DemoConfig) -> Any:
    from transformers import Phi3Config, Phi3ForCausalLM

    lc = _model_config(cfg.model)
    # transformers 5 still accepts the legacy rope_scaling keyword its signature omits.
    pc = Phi3Config(  # type: ignore[call-arg]
        vocab_size=lc.vocab_size,
        hidden_size=lc.hidden_size,
        intermediate_size=lc.intermediate_size,
        num_hidden_layers=lc.num_hidden_layers,
        num_attention_heads=lc.num_attention_heads,
        num_key_value_heads=lc.num_key_value_heads,
        rms_norm_eps=lc.rms_norm_eps,
        max_position_embeddings=lc.max_position_embeddings,
        original_max_position_embeddings=lc.max_position_embeddings,
        rope_scaling=None,
        tie_word_embeddings=lc.tie_word_embeddings,
        pad_token_id=0,
    )
    if pc.hidden_size // pc.num_attention_heads != lc.head_dim:
        raise ValueError("Phi3 derives head_dim from hidden_size / num_heads; this model differs")
    return Phi3ForCausalLM(pc).eval()  # type: ignore[no-untyped-call]  # unannotated upstream


def engine_main(engine: int, cfg: DemoConfig, port: int, token: str, out: Any) -> None:
    """One engine process: allocate the vLLM-layout shard, register it, wait for updates."""
    from weight_transfer.manifest import torch_dtype
    from weight_transfer.planner.presets.models import get_model_shape
    from weight_transfer.planner.presets.vllm import vllm_recipes, vllm_tensor_specs
    from weight_transfer.receiver import WeightReceiver

    torch.set_num_threads(1)
    shape = get_model_shape(cfg.model)
    tp_rank, fp8 = cfg.engine_layout(engine)
    recipes = vllm_recipes(shape, tp_rank, cfg.engine_ranks, fp8=fp8)
    specs = vllm_tensor_specs(
        shape, tp_rank, cfg.engine_ranks, fp8=fp8, param_dtype=cfg.engine_dtype
    )
    g = torch.Generator().manual_seed(10_000 + cfg.seed * 100 + engine)
    module = None
    tensors: dict[str, torch.Tensor] = {}
    if cfg.engine_model == "phi3":
        module = _phi3(cfg).to(torch_dtype(cfg.engine_dtype))
        tensors = dict(module.named_parameters())
    else:
        for s in specs:
            # Random fill, never zeros: an unwritten byte or a wrong offset cannot pass.
            tensors[s.name] = torch.randn(s.shape, generator=g).to(torch_dtype(s.dtype))
    receiver = WeightReceiver(
        module if module is not None else tensors,
        recipes,
        transfer_config(cfg, port, token, "engine"),
        engine=f"engine{engine}",
    )
    try:
        for step in range(1, cfg.steps + 1):
            receiver.wait_for_version(step, cfg.timeout_s)
            if cfg.return_tensors:
                out.put(("engine", engine, step, _pack(tensors)))
            if module is not None:
                with torch.no_grad():
                    logits = module(input_ids=probe_tokens(cfg)).logits
                out.put(("logits", "engine", step, _pack({"x": logits})))
            receiver.publish_digests(step)
        # Stay registered until the trainers have verified the last update, then say so: the
        # trainers' rank 0 closes the store (its controller) only after every engine has, or an
        # engine still on its way to reading "finished" would lose the controller instead.
        receiver._control.get(f"finished/{cfg.steps}", _Finished, cfg.timeout_s)
        receiver._control.put(f"finished/{cfg.steps}/engine{engine}", _Finished(step=cfg.steps))
    finally:
        receiver.close()


@dataclasses.dataclass(frozen=True, slots=True)
class _Finished:
    step: int


def trainer_main(
    rank: int, cfg: DemoConfig, port: int, dist_port: int, token: str, out: Any
) -> None:
    """One trainer process: FSDP2 Llama on gloo, an AdamW step then a verified update, K times."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    from weight_transfer.manifest import torch_dtype
    from weight_transfer.planner.presets.models import get_model_shape
    from weight_transfer.planner.presets.vllm import vllm_recipes, vllm_tensor_specs
    from weight_transfer.planner.reference import materialize
    from weight_transfer.sender import WeightSender

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(dist_port)
    dist.init_process_group(
        "gloo",
        rank=rank,
        world_size=cfg.train_ranks,
        timeout=datetime.timedelta(seconds=cfg.timeout_s),
    )
    try:
        mesh = init_device_mesh("cpu", (cfg.train_ranks,))
        torch.manual_seed(cfg.seed)
        # transformers' decorated PreTrainedModel.to loses its signature in the stubs.
        model = LlamaForCausalLM(_model_config(cfg.model)).to(
            torch_dtype(cfg.trainer_dtype)  # type: ignore[arg-type]
        )
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        # Rank and world from the process group; rank 0's sender hosts the controller.
        sender = WeightSender(model, transfer_config(cfg, port, token))
        controller = sender.controller
        shape = get_model_shape(cfg.model)
        g = torch.Generator().manual_seed(cfg.seed + 1)
        vocab = shape.vocab_size
        for step in range(1, cfg.steps + 1):
            tokens = torch.randint(0, vocab, (2, 32), generator=g)
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            stats = sender.update(step)
            t_update = stats.seconds
            nbytes = torch.tensor([stats.nbytes], dtype=torch.int64)
            dist.all_reduce(nbytes)
            with torch.no_grad():
                full = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
            if rank == 0:
                assert controller is not None
                expected: dict[str, dict[str, torch.Tensor]] = {}
                for e in range(cfg.num_engines):
                    tp_rank, fp8 = cfg.engine_layout(e)
                    recipes = vllm_recipes(shape, tp_rank, cfg.engine_ranks, fp8=fp8)
                    specs = vllm_tensor_specs(
                        shape, tp_rank, cfg.engine_ranks, fp8=fp8, param_dtype=cfg.engine_dtype
                    )
                    expected[f"engine{e}"] = materialize(recipes, specs, full)
                if cfg.engine_model == "phi3":
                    ref = LlamaForCausalLM(_model_config(cfg.model)).to(
                        torch_dtype(cfg.trainer_dtype)  # type: ignore[arg-type]  # see above
                    )
                    ref.load_state_dict(full)
                    with torch.no_grad():
                        logits = ref.eval()(input_ids=probe_tokens(cfg)).logits
                    out.put(("logits", "trainer", step, _pack({"x": logits})))
                bad = controller.verify(step, expected, cfg.timeout_s)
                out.put(("update", step, t_update, int(nbytes.item()), tuple(bad)))
                if cfg.return_tensors:
                    out.put(
                        (
                            "expected",
                            step,
                            {int(k.removeprefix("engine")): _pack(v) for k, v in expected.items()},
                        )
                    )
        if rank == 0:
            sender._control.put(f"finished/{cfg.steps}", _Finished(step=cfg.steps))
            seen = [f"finished/{cfg.steps}/engine{e}" for e in range(cfg.num_engines)]
            if not sender._control.ready(seen, cfg.timeout_s):
                log.warning("demo: closing before every engine read the last verdict")
            trace = sender.trace_events()
            out.put(("trace", len(trace)))
        dist.barrier()
        sender.close()
    finally:
        dist.destroy_process_group()


def run_demo(
    cfg: DemoConfig, *, on_update: Callable[[UpdateReport], None] | None = None
) -> DemoResult:
    """Start the processes, wait for them (with `cfg.timeout_s`), and report what happened."""
    from weight_transfer.cli.launch import Child, Launch

    port = cfg.control_port or free_port()
    dist_port = free_port()
    token = cfg.control_token or secrets.token_hex(16)
    # The controller (trainer 0) hosts the control plane: the trainers start first.
    children = [
        Child(f"trainer{r}", trainer_main, (r, cfg, port, dist_port, token))
        for r in range(cfg.train_ranks)
    ] + [Child(f"engine{e}", engine_main, (e, cfg, port, token)) for e in range(cfg.num_engines)]
    result = DemoResult(updates=[], exit_codes={}, errors=[], engine_tensors={}, expected={})
    # After a failure the others get a short grace (they raise on their own timeouts).
    outcome = Launch(children).run(
        timeout_s=cfg.timeout_s,
        grace_s=15.0,
        on_message=lambda _child, msg: _handle(msg, result, on_update),
    )
    result.exit_codes = outcome.exit_codes
    result.errors.extend(outcome.errors)
    if len(result.updates) != cfg.steps:
        result.errors.append(f"{len(result.updates)} of {cfg.steps} updates reported")
    return result


def _handle(msg: Any, result: DemoResult, on_update: Callable[[UpdateReport], None] | None) -> None:
    kind = msg[0]
    if kind == "update":
        _, step, seconds, nbytes, bad = msg
        rep = UpdateReport(step=step, seconds=seconds, nbytes=nbytes, mismatches=tuple(bad))
        result.updates.append(rep)
        if on_update is not None:
            on_update(rep)
    elif kind == "engine":
        _, rank, step, tensors = msg
        result.engine_tensors.setdefault(step, {})[rank] = _unpack(tensors)
    elif kind == "logits":
        _, who, step, logits = msg
        result.logits.setdefault(who, {})[step] = _unpack(logits)["x"]
    elif kind == "expected":
        _, step, per_engine = msg
        result.expected[step] = {e: _unpack(v) for e, v in per_engine.items()}
