"""pdserve's vLLM general plugin: settings every process of an engine needs, TP ranks included.

With tensor parallelism the ranks are processes vLLM spawns (and on the async engine path
the engine core is one too), so anything patched in the actor's own process never reaches
them. vLLM runs its general plugins (entry point group `vllm.general_plugins`, declared in
pyproject.toml) in every process it starts, before the model and the KV connector are built;
`register` reads what the actor put in the environment. The actor's own process calls
`register` too, after setting the environment (vLLM may have loaded plugins there earlier).

- NIXL's progress thread, asleep in poll() (kv_transfer.progress_thread).
- CPU only: NixlConnector's worker moves the thread that builds it onto the host's last
  core; we put that thread back where it was, so each rank keeps the cores its OpenMP
  threads are bound to, and let the NIXL threads it started run on any of the process's
  cores, away from the forward (vllm_engine.cpu_affinity).
- CPU only: decode's Gated-DeltaNet conv update reads the dim-first state NIXL needs in place
  (vllm_engine.conv_state_update), for every engine that stores it so, colocated ones too.
- Where the CPU has AMX: permission to use its tiles (`allow_amx_tiles`).
- CPU only, pdserve's engines only: the sampler ranks sampled tokens among the logprobs
  eagerly (`rank_logprobs_eagerly`).
- pdserve's engines only: decoding keeps a hybrid's last state checkpoints, not one at every
  block end (vllm_engine.decode_checkpoints).
- A torch.compile cache key that engines share: vLLM keys its compile cache on its
  environment variables, NIXL's side-channel port and the CPU core binding among them, so
  with a port and cores of its own no engine ever found another's compiled model, nor its
  own after a restart. Neither changes the compiled code: the port is left out of the key,
  and a binding counts by its cores per rank.
- CPU only, pdserve's engines only: one gloo device for all of a process's groups
  (`share_one_gloo_device`).
"""

from __future__ import annotations

import functools
import os

from kv_transfer.progress_thread import PROGRESS_POLL_ENV

# Set in every pdserve engine's environment (EngineConfig.process_env): vLLM runs this plugin
# in any vLLM process of the environment it is installed in, a benchmark's stock vLLM server
# too, which must stay stock.
ENGINE_PROCESS_ENV = "PDSERVE_ENGINE_PROCESS"


def register() -> None:
    from kv_transfer.layout import DIM_FIRST_CONV_UPDATE_ENV
    from vllm_engine.cpu_affinity import remember_process_cores

    remember_process_cores()  # before vLLM binds this process's threads to the engine's cores
    allow_amx_tiles()  # any vLLM here: without it vLLM's own AMX kernel may die of SIGILL
    if os.environ.get(ENGINE_PROCESS_ENV) == "1":
        rank_logprobs_eagerly()
        from vllm_engine.decode_checkpoints import install as keep_last_decode_checkpoints

        keep_last_decode_checkpoints()
        share_one_gloo_device()
    _share_compile_cache_key()

    if os.environ.get(DIM_FIRST_CONV_UPDATE_ENV) == "1":
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            from vllm_engine.conv_state_update import install

            install()
    poll = os.environ.get(PROGRESS_POLL_ENV)
    if poll is None:  # not a pdserve engine process
        return
    from kv_transfer.progress_thread import configure_nixl_progress_thread

    configure_nixl_progress_thread(None if poll == "none" else int(poll))
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        _place_connector_threads()


def _place_connector_threads() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker

    from vllm_engine.cpu_affinity import free_threads, python_thread_ids, thread_ids

    init = NixlBaseConnectorWorker.__init__
    if getattr(init, "keeps_cpu_affinity", False):
        return

    @functools.wraps(init)
    def init_placing_threads(self, *args, **kwargs) -> None:  # noqa: ANN001
        cores = os.sched_getaffinity(0)
        before = thread_ids()
        init(self, *args, **kwargs)
        os.sched_setaffinity(0, cores)
        free_threads(thread_ids() - before - python_thread_ids())  # NIXL's own (progress, UCX)

    init_placing_threads.keeps_cpu_affinity = True  # type: ignore[attr-defined]
    NixlBaseConnectorWorker.__init__ = init_placing_threads


def allow_amx_tiles() -> None:
    """Ask Linux for this process's AMX tile state on a CPU that has it.

    Linux hands AMX tile registers only to a process that asked (arch_prctl
    ARCH_REQ_XCOMP_PERM); any other gets SIGILL at its first tile instruction. vLLM's CPU
    attention kernel picks AMX on such a CPU but never asks: it works only once oneDNN has
    asked for its own AMX GEMMs, which a prefill of many tokens does. A decode engine's first
    step after a handoff reaches the attention kernel first and died of SIGILL (tiny Gemma 3
    and Qwen3 on a Xeon with AMX). PyTorch's `_init_amx` makes the request."""
    import torch

    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()


def share_one_gloo_device() -> None:
    """vLLM makes a process group per parallel dimension (TP, PP, DP, EP, ...), each twice
    (device and CPU groups, both gloo on CPU), at TP 1 too, and torch gives each gloo group a
    device of its own, whose TCP loop thread wakes every 10 ms, busy or not (what that costs
    an idle engine: docs/benchmarks.md). One device serves many groups (gloo keys each
    group's connections apart), so the process's groups share one. `_Options` is torch's
    own, unexported: tests/test_plugin_process.py notices if a torch upgrade changes it."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import torch.distributed.distributed_c10d as c10d

    gloo = c10d.ProcessGroupGloo
    if getattr(gloo, "shares_one_device", False):
        return
    devices: list = []

    class ProcessGroupGlooOnOneDevice(gloo):  # type: ignore[misc, valid-type]
        shares_one_device = True

        def __init__(self, store, rank: int, size: int, timeout) -> None:  # noqa: ANN001
            if not devices:
                devices.append(gloo.create_default_device())
            options = gloo._Options()
            options._devices = devices
            options._timeout = timeout
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = ProcessGroupGlooOnOneDevice


def rank_logprobs_eagerly() -> None:
    """vLLM's sampler ranks each sampled token among the logprobs with an op it compiles
    (torch.compile, inductor) on first use: in an engine process's first request asking for
    logprobs, inside that request's time to first token. On CPU that compile took 3-6 s
    (docs/benchmarks.md), for every engine process and after every restart, where the eager
    op costs a few milliseconds a step. CPU engines, compiled or not, run it eager; GPU
    engines keep vLLM's compiled op."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import vllm.v1.sample.sampler as sampler

    compiled = sampler.batched_count_greater_than
    sampler.batched_count_greater_than = getattr(compiled, "_torchdynamo_orig_callable", compiled)


def _share_compile_cache_key() -> None:
    import vllm.envs as envs

    factors_of = envs.compile_factors
    if getattr(factors_of, "shared_by_engines", False):
        return

    @functools.wraps(factors_of)
    def compile_factors() -> dict[str, object]:
        factors = factors_of()
        factors.pop("VLLM_NIXL_SIDE_CHANNEL_PORT", None)
        binding = factors.get("VLLM_CPU_OMP_THREADS_BIND")
        if isinstance(binding, str) and binding not in ("", "auto", "nobind", "all"):
            factors["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(_count_cores(r)) for r in binding.split("|"))
        return factors

    compile_factors.shared_by_engines = True  # type: ignore[attr-defined]
    envs.compile_factors = compile_factors


def _count_cores(cores: str) -> int:
    """Cores in a list such as "0-3,8" (VLLM_CPU_OMP_THREADS_BIND's syntax for one rank)."""
    count = 0
    for part in cores.split(","):
        low, _, high = part.partition("-")
        count += int(high) - int(low) + 1 if high else 1
    return count
