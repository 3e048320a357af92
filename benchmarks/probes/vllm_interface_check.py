"""Check the vLLM plug-in's classes against the installed vLLM's weight-transfer interface.

Run it with the vLLM to check first on the path, for example a release's Python files extracted
from its wheel (no GPU needed; the checks build no model):

    unzip -q vllm-0.26.0-*.whl '*.py' -d /tmp/v026
    PYTHONPATH=/tmp/v026 python benchmarks/probes/vllm_interface_check.py

What it checks, with the installed vLLM's own base classes and factories:
1. `register()` registers `weight_transfer` in both factories, and not the refusing stand-in;
2. the worker engine class has no abstract method left (vLLM can build it);
3. the trainer side, called the way that release's `WeightTransferTrainerFactory.trainer_init`
   calls it, goes through our `trainer_init` into `OneSidedUpdater`: a real control plane is
   started on a free port and the client's `init_weight_transfer_engine` is reached (the fake
   client then refuses, which must come back as our "vLLM did not join" error), and the
   trainer engine's constructor accepts that release's base-class arguments.
Prints one line per check and exits non-zero on the first failure.
"""

from __future__ import annotations

import inspect
import secrets
import socket
import sys
from typing import Any

import torch


class _RefusingClient:
    """A vLLM client whose first phase refuses: proves the trainer path reached vLLM."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        raise RuntimeError("probe client: refused on purpose")

    def start_weight_update(self) -> None:
        raise AssertionError("not reached")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        raise AssertionError("not reached")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        raise AssertionError("not reached")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    import vllm
    from vllm.distributed.weight_transfer import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )
    from vllm.distributed.weight_transfer.base import ModuleSource

    from weight_transfer.engines.vllm import (
        BACKEND,
        ControlPlaneConfig,
        TrainerInitInfo,
        TransferConfig,
    )
    from weight_transfer.engines.vllm import worker as plugin
    from weight_transfer.errors import WeightTransferError

    print(f"vLLM {vllm.__version__} from {vllm.__file__}")
    interface = plugin.vllm_interface()
    print(f"interface: {interface}")
    plugin.register()
    plugin.register()  # idempotent: vLLM may load plug-ins more than once per process
    worker_cls = WeightTransferEngineFactory._registry[BACKEND]()
    trainer_cls = WeightTransferTrainerFactory._registry[BACKEND]()
    assert worker_cls is plugin.OneSidedWeightTransferEngine, worker_cls
    assert trainer_cls is plugin.OneSidedTrainerWeightTransferEngine, trainer_cls
    print("ok 1: register() put both engines in vLLM's factories")

    abstract = sorted(getattr(worker_cls, "__abstractmethods__", ()))
    assert not abstract, f"worker engine leaves abstract methods: {abstract}"
    print("ok 2: the worker engine implements every abstract method of this vLLM's base class")

    model = torch.nn.Linear(4, 4)
    info = TrainerInitInfo(
        config=TransferConfig(
            num_engines=1,
            control=ControlPlaneConfig(port=_free_port(), token=secrets.token_hex(16)),
        )
    )
    factory_params = inspect.signature(WeightTransferTrainerFactory.trainer_init).parameters
    kwargs: dict[str, Any] = {"client": _RefusingClient(), "source": ModuleSource(model)}
    try:
        # Each branch is one release's calling convention, whichever vLLM's stubs the type
        # checker sees; our TrainerInitInfo stands in for vLLM's (the factory passes it on).
        trainer_init: Any = WeightTransferTrainerFactory.trainer_init
        if "backend" in factory_params:  # vLLM 0.26: (backend, config, init_info, ...)
            from vllm.config import WeightTransferConfig

            trainer_init(BACKEND, WeightTransferConfig(backend=BACKEND), info, **kwargs)
        else:  # vLLM 0.27 and later: (init_info, ...), backend read from init_info
            trainer_init(info, **kwargs)
    except WeightTransferError as exc:
        assert "did not join" in str(exc) and "refused on purpose" in str(exc), exc
    else:
        raise AssertionError("the refusing client was never reached")
    print("ok 3a: the factory's trainer_init call reached vLLM's first phase through ours")

    class _Updater:
        def close(self) -> None:
            pass

    engine = trainer_cls(
        None,
        client=_RefusingClient(),
        source=ModuleSource(model),
        is_sender=True,
        updater=_Updater(),  # type: ignore[arg-type]  # a stand-in: only close() is called
    )
    assert engine.is_sender and engine.client is not None
    print("ok 3b: the trainer engine's constructor takes this vLLM's base-class arguments")
    return 0


if __name__ == "__main__":
    sys.exit(main())
