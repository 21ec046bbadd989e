"""CPU support for megatron-core: the one place where its CUDA assumptions are redirected.

megatron-core 0.16 is written for GPUs. Its model, DDP, optimizer and pipeline schedules
run unchanged on CPU with gloo once these call sites are redirected:

=========================================  =============================================
what megatron-core does                    what happens here, and why
=========================================  =============================================
``torch.cuda.current_device()``            returns 0; device 0 is then mapped to CPU by the
(p2p_communication, param_and_grad_buffer,  mode below (a CPU build raises otherwise)
utils)
``torch.cuda.synchronize/empty_cache``     no-ops: there is nothing to wait for on CPU
``device="cuda"``, integer devices,        a ``TorchFunctionMode`` rewrites the device to
``.cuda()``, ``.to("cuda")`` (schedules,    CPU on every torch call that names one
optimizer, clip_grads, language_module)
``Tensor.type() == 'torch.cuda.XTensor'``  the same mode answers ``torch.cuda.XTensor`` for
(clip_grads, optimizer, distrib_optimizer)  CPU tensors, so the dtype dispatch picks the
                                           right branch instead of raising
the CUDA RNG tracker                       replaced by ``CpuRNGStatesTracker``, which forks
(tensor_parallel/random, used by attention  the CPU generator the same way
dropout)
denormal floats in CPU matmuls            flushed to zero (``torch.set_flush_denormal``):
                                           they slow CPU kernels many times over, and every
                                           layout flushes alike, so results still agree
fused kernels, gradient accumulation       switched off in the model config
fusion, ``use_cpu_initialization``         (``megatron_parcae.training.models``), not here
``jit_fuser = torch.compile`` on the fused  ``import_megatron_core()`` imports megatron-core
kernels at import (megatron.core.jit)      with ``torch.compile`` passing functions through,
                                           then keeps megatron's own ``disable_jit_fuser``:
                                           the kernels are off on CPU, and compiling them
                                           loads dynamo and inductor, about 2 s of every
                                           process's start
=========================================  =============================================

``enable_cpu_support()`` does all of this once per process and does nothing when CUDA is
available, so GPU runs execute megatron-core untouched. The mode takes every torch call
through Python, 8.5% of a GPT-tiny CPU step and 19.4% of the tests' smaller model's
(benchmarks/results/cpu_mode_cost.txt).
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch.overrides import TorchFunctionMode

from reconfig import compat

_ENABLED = False


def _names_cuda(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int is a CUDA ordinal in torch's device arguments; bool is not a device.
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites every CUDA device named in a torch call to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.autograd.backward and hasattr(torch.autograd.Variable, "_execution_engine"):
            return self._backward(*args, **kwargs)
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else "torch.cuda." + name[len("torch."):]
        if _names_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.to and len(args) > 1 and _names_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)

    def _backward(self, tensors, grad_tensors=None, retain_graph=None, create_graph=False, inputs=None):
        """torch.autograd.backward with this mode on: it is off while its own handler runs,
        and the backward of a recomputed layer (activation recomputation calls
        torch.autograd.backward) names CUDA devices like its forward. Autograd's engine is
        private torch state: without it, backward runs as before (gated in the caller)."""
        tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        if grad_tensors is None or isinstance(grad_tensors, torch.Tensor):
            grad_tensors = (grad_tensors,) * len(tensors) if grad_tensors is None else (grad_tensors,)
        if any(g is None and t.numel() != 1 for t, g in zip(tensors, grad_tensors)):
            raise RuntimeError("grad can be implicitly created only for scalar outputs")
        grads = tuple(torch.ones_like(t) if g is None else g for t, g in zip(tensors, grad_tensors))
        inputs = () if inputs is None else ((inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs))
        with self:
            torch.autograd.Variable._execution_engine.run_backward(
                tensors, grads, create_graph if retain_graph is None else retain_graph, create_graph, inputs,
                allow_unreachable=True, accumulate_grad=True)


class CpuRNGStatesTracker:
    """Named CPU generator states, with the interface megatron-core's CUDA tracker has.

    Attention dropout forks the tracker's model-parallel state; on CPU that state must
    live in the CPU generator.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"RNG state {name!r} or seed {seed} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} is not added")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def import_megatron_core() -> None:
    """Import megatron-core; on CPU without torch.compile-decorating its fused kernels.

    ``megatron.core.jit.disable_jit_fuser`` alone comes too late: the package's
    ``__init__`` imports the kernels, decorated, before it can be called. Its inference
    contexts and timers import wandb where it is installed (half a second a process),
    which training never uses through them: they see none, and the project's wandb
    backend imports it when a run asks for it.
    """
    if "megatron.core" in sys.modules:
        return
    compile_, wandb, on_cpu = torch.compile, sys.modules.get("wandb"), not torch.cuda.is_available()
    if on_cpu:
        torch.compile = _pass_through
    if wandb is None:
        sys.modules["wandb"] = None  # an import of it raises ImportError
    try:
        import megatron.core.jit

        if on_cpu:
            megatron.core.jit.disable_jit_fuser()
    finally:
        torch.compile = compile_
        if wandb is None:
            del sys.modules["wandb"]


def _pass_through(model=None, **options):
    return (lambda fn: fn) if model is None else model


def enable_cpu_support() -> bool:
    """Redirect megatron-core's CUDA call sites to the CPU; a no-op where CUDA exists.

    Returns whether the CPU redirection is active.
    """
    global _ENABLED
    if torch.cuda.is_available():
        return False
    if _ENABLED:
        return True
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.empty_cache = lambda: None
    compat.install_rng_tracker(CpuRNGStatesTracker())
    torch.set_flush_denormal(True)
    _CudaToCpuMode().__enter__()  # for the life of the process
    _ENABLED = True
    return True
