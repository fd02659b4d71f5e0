"""Every private API of diffusers and Triton this package calls, in one place, with the versions it was read from.

The rest of the package calls these functions, never the private names themselves; when a new diffusers or
Triton release moves one of them, this file is the one to change (and pyproject.toml's pins with it).
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch


# ---------------------------------------------------------------------------------------------------- diffusers

DIFFUSERS_VERSION = "0.42.1"
"""The diffusers release the functions below were read from (``diffusers/models/attention_dispatch.py``,
``diffusers/hooks/context_parallel.py``, ``diffusers/models/modeling_utils.py``); CI tests it."""


def templated_context_parallel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                         scale: float | None, enable_gqa: bool, *, forward_op: Callable[..., Any],
                                         backward_op: Callable[..., Any], parallel_config: Any) -> torch.Tensor:
    """``attention_dispatch._templated_context_parallel_attention``: diffusers' Ulysses / ring schedule of
    ``(B, N, H, D)`` shards around ``forward_op``, with no mask, no dropout, not causal, no LSE returned."""
    from diffusers.models.attention_dispatch import _templated_context_parallel_attention

    return _templated_context_parallel_attention(query, key, value, None, 0.0, False, scale, enable_gqa, False,
                                                 forward_op=forward_op, backward_op=backward_op,
                                                 _parallel_config=parallel_config)


def unshard(x: torch.Tensor, dim: int, cp: Any) -> torch.Tensor:
    """``x``'s shards of every rank of a ``ContextParallelConfig``'s group joined along ``dim``, in the order
    diffusers' ``_cp_plan`` hooks split the sequence: the flattened ring x Ulysses mesh (``cp._flattened_mesh``),
    unequal shards in the "anything" modes (``hooks.context_parallel``'s sharders)."""
    from diffusers.hooks.context_parallel import EquipartitionSharder, PartitionAnythingSharder

    mesh = cp._flattened_mesh
    if cp.ulysses_anything or cp.ring_anything:
        return PartitionAnythingSharder.unshard_anything(x, dim, mesh)
    return EquipartitionSharder.unshard(x, dim, mesh)


def cp_plan(model: torch.nn.Module) -> Any:
    """A diffusers model's context-parallel plan (``model._cp_plan``), or ``None`` where it has none."""
    return getattr(model, "_cp_plan", None)


def carry_parallel_config(installed: Any, new: Any) -> Any:
    """``new``, given the diffusers parallel config ``installed`` runs with (``model.enable_parallelism`` sets
    ``_parallel_config`` on the processors present when it runs): without it a processor installed or put
    back later would attend to its rank's shard of the sequence only."""
    config = getattr(installed, "_parallel_config", None)
    if config is not None and hasattr(new, "_parallel_config"):
        new._parallel_config = config
    return new


@contextlib.contextmanager
def device_count_at_least_one() -> Iterator[None]:
    """``torch.accelerator.device_count()`` reads 1 on a host without an accelerator: diffusers'
    ``enable_parallelism`` (``_resolve_parallel_config``) takes ``rank % device_count()`` for the rank's
    device, which divides by zero there (``cpu:0`` then)."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or accelerator.device_count() > 0:
        yield
        return
    count = accelerator.device_count
    accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        accelerator.device_count = count


# ---------------------------------------------------------------------------------------------------- Triton

TRITON_VERSIONS = ("3.6.0", "3.8.0")
"""The Triton releases the functions below were read from: 3.6.0, the GPU machine's (where the kernels run), and
3.8.0, the CPU machine's and CI's (where they run in Triton's interpreter): ``triton/runtime/autotuner.py``,
``triton/compiler/compiler.py``, ``triton/knobs.py``, ``triton/runtime/jit.py`` and
``triton/experimental/gluon/_runtime.py``."""


def _hooked_autotuner() -> type:
    """``HookedAutotuner``, defined on first use (module ``__getattr__``): Triton is imported only where it is
    used, so the package imports where Triton is not installed (``pyproject.toml`` installs it on Linux only)."""
    from triton.runtime.autotuner import Autotuner

    class HookedAutotuner(Autotuner):
        """Triton's ``Autotuner`` with the private steps it takes on a key's first launch turned into hooks
        that a subclass overrides, and its private state read through properties.

        Triton's autotuner (3.6 and 3.8) keys each launch by the key arguments' values, then the dtype of each
        tensor argument (:meth:`tuning_key`); on a key missing from its in-memory cache (:attr:`choices`) it
        reads its disk cache (``cache_results``), else prunes the pool (``prune_configs``: then :meth:`choose`)
        and times each config left (``_bench``: :meth:`should_time`, :meth:`timed`).  A launch of a known key
        calls none of the hooks but :meth:`before_launch` and :meth:`after_launch`."""

        def __init__(self, kernel: Any, configs: list, key: list[str], prune: Callable[..., list], *,
                     do_bench: Callable[..., Any] | None = None, cache_results: bool = True) -> None:
            super().__init__(kernel, kernel.arg_names, configs, key, None, None,
                             prune_configs_by={"early_config_prune": prune}, do_bench=do_bench,
                             cache_results=cache_results)

        @property
        def key_names(self) -> list[str]:
            """The arguments the choice is keyed by (``Autotuner.keys``)."""
            return list(self.keys)

        @property
        def param_names(self) -> list[str]:
            """The kernel's arguments, in order (``Autotuner.arg_names``)."""
            return list(self.arg_names)

        @property
        def pool(self) -> list:
            """Every config (``Autotuner.configs``), before any prune."""
            return list(self.configs)

        @property
        def choices(self) -> dict:
            """Tuning key -> the config chosen for it in this process (``Autotuner.cache``)."""
            return self.cache

        def forget_choices(self) -> None:
            """Empty the in-memory cache: the next launch of each key chooses again."""
            self.cache.clear()

        @property
        def disk_cache(self) -> bool:
            """Whether choices are read from and written to Triton's cache directory (``cache_results``)."""
            return self.cache_results

        @disk_cache.setter
        def disk_cache(self, on: bool) -> None:
            self.cache_results = on

        def tuning_key(self, args: tuple, kwargs: dict) -> tuple:
            """The key ``Autotuner.run`` caches a launch's choice under: the key arguments' values, then ``str(dtype)``
            of each argument that has one, in argument order (the kernel's arguments among ``kwargs`` after the
            positional ones, as its ``{**nargs, **kwargs}``)."""
            named = dict(zip(self.arg_names, args))
            params = set(self.arg_names)
            named.update((k, v) for k, v in kwargs.items() if k in params)
            return tuple([named[k] for k in self.keys if k in named]
                         + [str(v.dtype) for v in named.values() if hasattr(v, "dtype")])

        def launch_args(self) -> dict:
            """The current launch's kernel arguments by name (``Autotuner.nargs``), inside :meth:`choose`."""
            return dict(self.nargs)

        # ---- the hooks -----------------------------------------------------------------------------------

        def before_launch(self) -> None:
            """Called before every launch."""

        def after_launch(self) -> None:
            """Called after every launch."""

        def choose(self, pruned: list, kwargs: dict) -> list:
            """The configs to time for a key met for the first time, given the pool's prune ``pruned`` (default:
            all of them).  One config left is run without timing on Triton 3.8; 3.6 times it unless
            :meth:`should_time` says no."""
            return pruned

        def should_time(self, config: Any) -> bool:
            """Whether to time ``config`` (default yes); a config not timed reads 0 ms."""
            return True

        def timed(self, config: Any, ms: float) -> None:
            """Called with each timed config's median time in ms."""

        # ---- Triton's private steps ----------------------------------------------------------------------

        def run(self, *args: Any, **kwargs: Any) -> Any:
            self.before_launch()
            result = super().run(*args, **kwargs)
            self.after_launch()
            return result

        def prune_configs(self, kwargs: dict) -> list:
            return self.choose(super().prune_configs(kwargs), kwargs)

        def _bench(self, *args: Any, config: Any, **meta: Any) -> list[float]:
            if not self.should_time(config):
                return [0.0, 0.0, 0.0]
            result = super()._bench(*args, config=config, **meta)
            self.timed(config, result[0] if isinstance(result, (list, tuple)) else result)
            return result

    HookedAutotuner.__qualname__ = "HookedAutotuner"
    return HookedAutotuner


def __getattr__(name: str) -> Any:
    if name == "HookedAutotuner":
        globals()[name] = _hooked_autotuner()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def kernel_name(kernel: Any) -> str:
    """The Python name of a jitted kernel, through any wrappers (``Autotuner``, ``Heuristics``: ``.fn``)."""
    while not hasattr(kernel, "__name__"):
        kernel = kernel.fn
    return kernel.__name__


def cache_dir() -> Path | None:
    """Triton's cache directory (``knobs.cache.dir``: ``TRITON_CACHE_DIR``, default ``~/.triton/cache``), or
    ``None`` where ``TRITON_CACHE_MANAGER`` names another cache manager (a remote cache, say)."""
    from triton import knobs

    if os.environ.get("TRITON_CACHE_MANAGER"):
        return None
    return Path(knobs.cache.dir)


def cached_kernels(folder: str | os.PathLike) -> int:
    """How many compiled kernels a Triton cache directory holds: its entries (one folder per compile key) with a
    group file (``__grp__<kernel>.json``, written last), launchers and autotuner timings not counted."""
    root = Path(folder)
    if not root.is_dir():
        return 0
    return sum(1 for entry in root.iterdir() if entry.is_dir() and any(
        p.name.startswith("__grp__") and not p.name.endswith(".autotune.json") for p in entry.iterdir()))


CompileEvent = Callable[[str, str, bool], None]
"""A compile listener: ``(module, kernel, cache_hit)`` after each kernel ``triton.compile`` made (``cache_hit``
False) or loaded from Triton's cache directory (True); ``module`` is the kernel's Python module."""


def add_compile_listener(listener: CompileEvent) -> Callable[[], None]:
    """Call ``listener`` after each kernel compiled or loaded in this process (``knobs.compilation.listener``: one
    slot, which the listener before it keeps, called first); returns the function that removes it."""
    from triton import knobs

    before = knobs.compilation.listener

    def chained(*, src: Any, metadata: Any, metadata_group: Any, times: Any, cache_hit: bool) -> None:
        if before is not None:
            before(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)
        fn = getattr(src, "fn", None)
        listener(getattr(fn, "__module__", "") or "", getattr(src, "name", "") or "", cache_hit)

    knobs.compilation.listener = chained

    def remove() -> None:
        if knobs.compilation.listener is chained:
            knobs.compilation.listener = before

    return remove


def specialization(fn: Any, args: list, meta: dict) -> tuple[dict, dict, dict]:
    """Triton's specialisation of the launch arguments ``args`` (and constexprs ``meta``) of the jitted ``fn``:
    ``(signature, constexprs, attrs)`` as a launch makes it (``native_specialize_impl``: ints equal to 1 become
    constexprs, pointers and ints divisible by 16 say so)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    signature, constexprs, attrs = {}, {}, {}
    values = iter(args)
    for p in fn.params:
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constexprs[p.name] = meta[p.name]
            continue
        value = next(values)
        ty, spec = native_specialize_impl(BaseBackend, value, False, not p.do_not_specialize,
                                          not p.do_not_specialize_on_alignment)
        if ty == "constexpr":
            signature[p.name] = "constexpr"
            constexprs[p.name] = value
        else:
            signature[p.name] = ty
            if spec == "D":
                attrs[(p.num,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def current_cuda_device() -> int:
    """The device a Triton launch goes to now (``driver.active.get_current_device``: torch's current device)."""
    from triton.runtime import driver

    return driver.active.get_current_device()


def launch_values(fn: Any, args: Sequence, meta: dict) -> tuple:
    """Every parameter's value of the jitted ``fn`` in signature order, as its launcher takes them: ``args`` (the
    positional ones), then each later parameter's constexpr from ``meta`` or its default (``meta``'s launch
    options, ``num_warps`` and the like, are not parameters; ``fn.params``, ``triton/runtime/jit.py``)."""
    return (*args, *(meta[p.name] if p.name in meta else p.default for p in fn.params[len(args):]))


def launch_compiled(compiled: Any, grid: Sequence[int], values: Sequence, device: int) -> None:
    """Launch ``compiled`` (what ``fn[grid](...)`` returns) on ``grid`` with ``values`` (:func:`launch_values`) on
    ``device``'s current stream, with Triton's launch hooks: the launch ``JITFunction.run`` makes once it has
    bound and specialized the arguments (``CompiledKernel.run``, ``launch_metadata``, ``knobs.runtime``)."""
    from triton import knobs
    from triton.runtime import driver

    stream = driver.active.get_current_stream(device)
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                 compiled.function, compiled.packed_metadata, compiled.launch_metadata(grid, stream, *values),
                 knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *values)


def compile_for_cuda(fn: Any, signature: dict, constexprs: dict, attrs: dict, options: dict, *, capability: int = 90,
                     gluon: bool = False) -> Any:
    """``fn`` (a Triton or, with ``gluon``, a Gluon kernel) compiled for CUDA compute capability ``capability``
    without a GPU: the compiled kernel, its ``asm`` (``ttgir``, ``ptx``, ``cubin``) and ``metadata``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as source_class
    else:
        source_class = ASTSource
    src = source_class(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)


def cuda_tool(name: str) -> str:
    """The path of one of the CUDA tools Triton ships beside its ``ptxas`` (``ptxas``, ``cuobjdump``)."""
    from triton.backends.nvidia.compiler import get_ptxas

    return os.path.join(os.path.dirname(get_ptxas(90).path), name)
