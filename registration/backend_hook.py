# Registers the "zeroplus" c10d backend with torch.distributed. This text is embedded into
# libzeroplus.so and run by python_hook.cpp while the library is being loaded, so that
# `torch.ops.load_library(path)` alone is enough for init_process_group(backend="zeroplus").
# It runs in the interpreter's __main__ namespace, so it defines one function and deletes it.
def __zeroplus_backend_hook():
    import warnings

    import torch
    import torch.distributed as dist

    if not dist.is_available():
        return
    built = "@ZEROPLUS_TORCH_VERSION@"

    def minor(version):
        return tuple(version.split("+")[0].split(".")[:2])

    mismatch = None
    if minor(built) != minor(torch.__version__):
        mismatch = (
            f"zeroplus: libzeroplus.so was built for torch {built} but this process runs torch "
            f"{torch.__version__}; the c10d ABI changes between minor versions, so rebuild zeroplus "
            f"against torch {torch.__version__}"
        )

    def create_zeroplus_backend(options, pg_options):
        if mismatch:
            raise RuntimeError(mismatch)
        # zeroplus.BackendOptions is recognised by duck typing: this hook must not import the
        # zeroplus package (a bare torch.ops.load_library is enough to register the backend).
        forward = getattr(pg_options, "_zeroplus_options", None)
        if pg_options is not None and not callable(forward):
            raise TypeError(
                f"zeroplus: pg_options must be None or a zeroplus.BackendOptions, got "
                f"{type(pg_options).__name__}; see docs/backend.md for the knobs"
            )
        # A scratch ProcessGroup carries the C++ backend across the boundary: attach() builds it
        # and sets it on the scratch group; _get_backend returns torch's own Backend wrapper,
        # which c10d then registers on the real group. No pybind11 code lives in zeroplus.
        # Ctrl-C must reach a rank blocked in a collective (process_group/adapter/
        # interrupt_watch.hpp); only while KeyboardInterrupt is the SIGINT behaviour, so a
        # program's own SIGINT handler keeps its ops running.
        import signal
        import threading

        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            torch.ops.zeroplus.watch_interrupts()
        scratch = dist.ProcessGroup(options.store, options.group_rank, options.group_size)
        timeout_ms = int(options.timeout.total_seconds() * 1000)
        torch.ops.zeroplus.attach(
            scratch.boxed(), timeout_ms, str(options.group_id),
            [int(r) for r in options.global_ranks_in_group],
            forward() if pg_options is not None else [],
        )
        attach_interhost(scratch, options)
        return scratch._get_backend(torch.device("cpu"))

    def attach_interhost(scratch, options):
        # A group that spans hosts runs hierarchical collectives with torch's own Gloo between
        # hosts (docs/multihost.md): one Gloo group per local index (rank = host index), over a
        # prefixed view of the group's store, bound where the zeroplus mesh is (the interface of
        # ZEROPLUS_SOCKET_IFNAME / GLOO_SOCKET_IFNAME, else the address the mesh published).
        # The C++ side says whether it wants one: the topology decides, the same on every rank.
        # `scope` prefixes every key of this group instance (process_group/core/group_session.hpp):
        # Gloo must not read a rendezvous key an earlier attempt of a restarted job left behind.
        plan, ifname, address, scope = torch.ops.zeroplus.interhost_plan(scratch.boxed())
        if not plan:
            return
        host, hosts, local = (int(x) for x in plan)
        where = f"interface {ifname}" if ifname else f"address {address}"
        try:
            gloo_options = dist.ProcessGroupGloo._Options()
            gloo_options._timeout = options.timeout
            if ifname:
                device = dist.ProcessGroupGloo.create_device(interface=ifname)
            else:
                device = dist.ProcessGroupGloo.create_device(hostname=address)
            gloo_options._devices = [device]
            store = dist.PrefixStore(f"{scope}/interhost/{local}", options.store)
            gloo = dist.ProcessGroupGloo(store, host, hosts, gloo_options)
            wrapper = dist.ProcessGroup(store, host, hosts)
            wrapper._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
        except Exception as error:
            raise RuntimeError(
                f"zeroplus init: rank {options.group_rank} could not create the inter-host Gloo group "
                f"(host {host} of {hosts}, local index {local}, {where}): {error}; "
                f"ZEROPLUS_INTERHOST=tcp keeps the flat TCP algorithms instead"
            ) from error
        torch.ops.zeroplus.attach_interhost(scratch.boxed(), wrapper.boxed())

    if "ZEROPLUS" not in dist.Backend._plugins:
        dist.Backend.register_backend(
            "zeroplus", create_zeroplus_backend, extended_api=True, devices=["cpu", "cuda"]
        )
    if mismatch:
        warnings.warn(mismatch, RuntimeWarning, stacklevel=2)


try:
    __zeroplus_backend_hook()
except Exception as __zeroplus_error:  # never let a load-time failure go unseen
    import sys as __zeroplus_sys
    print(f"zeroplus: could not register the backend: {__zeroplus_error!r}", file=__zeroplus_sys.stderr)
    del __zeroplus_sys, __zeroplus_error
finally:
    del __zeroplus_backend_hook
