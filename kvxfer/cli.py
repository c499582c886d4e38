"""``kvxfer`` command line: ``serve`` (the sidecar daemon), ``demo``, ``bench``, and the
control verbs ``status``, ``peers``, ``drain``, ``resume``, ``cancel``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from kvxfer import __version__
from kvxfer.config import Config, add_arguments, load_config
from kvxfer.errors import ConfigError
from kvxfer.protocol import DTYPE_SIZES


def _demo_parser(sub: argparse._SubParsersAction, full: bool = True) -> None:  # type: ignore[type-arg]
    """The ``demo`` command; ``full``: with its options, whose defaults load the test harness
    (~0.1 s of numpy and the synthetic engines: not for ``kvxfer status`` and the rest)."""
    p = sub.add_parser("demo", help="prefill + decode sidecars with synthetic engines, bytes verified")
    if not full:
        return
    from kvxfer.testing.demo import DemoOptions
    from kvxfer.testing.vllm_layouts import KINDS

    d = DemoOptions()
    p.add_argument("--requests", type=int, default=d.requests)
    p.add_argument("--in-flight", type=int, default=d.in_flight,
                   help="requests moved at once; the KV pools are sized to hold these (0: all)")
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--blocks-per-request", type=int, default=d.blocks_per_request)
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per block")
    p.add_argument("--heads", type=int, default=d.heads, help="KV heads")
    p.add_argument("--head-dim", type=int, default=d.head_dim)
    p.add_argument("--dtype", default=d.dtype, choices=sorted(DTYPE_SIZES))
    p.add_argument("--prefill-tp", type=int, default=d.prefill_tp)
    p.add_argument("--decode-tp", type=int, default=d.decode_tp)
    p.add_argument("--kv-heads", type=int, default=None, help="alias of --heads")
    p.add_argument("--mla", action="store_true", help="MLA: one latent of head-dim, on every rank")
    p.add_argument("--prefill-block-size", type=int, default=0, help="default: --block-size")
    p.add_argument("--decode-block-size", type=int, default=0, help="default: --block-size")
    p.add_argument("--head-layout", choices=["NHD", "HND"], default=d.head_layout)
    p.add_argument("--kv-layout", choices=KINDS, default="", metavar="KIND",
                   help="allocate the KV cache as this vLLM attention backend does and register it "
                        f"through the connector's code: {', '.join(KINDS)} (default: kvxfer's dense layout)")
    p.add_argument("--decode-kv-layout", choices=KINDS, default="", metavar="KIND",
                   help="the decode side's layout, when it differs from --kv-layout")
    p.add_argument("--contiguous-blocks", action="store_true",
                   help="give requests runs of consecutive block ids on both sides (a fresh vLLM "
                        "allocator does; default: random ids, as in a busy engine)")
    p.add_argument("--ucx-error-mode", choices=["peer", "none"], default=d.ucx_error_mode)
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds")
    p.add_argument("--json", action="store_true", help="last line: one JSON object")


def _run_demo(args: argparse.Namespace) -> int:
    from kvxfer.testing.demo import DemoOptions, run_demo

    opts = DemoOptions(
        requests=args.requests,
        in_flight=args.in_flight,
        layers=args.layers,
        blocks_per_request=args.blocks_per_request,
        block_size=args.block_size,
        heads=args.kv_heads or args.heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        mla=args.mla,
        prefill_block_size=args.prefill_block_size,
        decode_block_size=args.decode_block_size,
        head_layout=args.head_layout,
        kv_layout=args.kv_layout,
        decode_kv_layout=args.decode_kv_layout,
        contiguous_blocks=args.contiguous_blocks,
        ucx_error_mode=args.ucx_error_mode,
        timeout_s=args.timeout,
    )
    try:
        mib = opts.request_bytes() / (1 << 20)
        opts.check_memory()
    except (KeyError, ValueError, MemoryError) as e:
        print(f"kvxfer demo: {e}", file=sys.stderr)
        return 2
    kv = "MLA latent" if opts.is_mla else f"K/V x {opts.heads} heads"
    where = (f"vLLM layout {opts.kv_layout_of('prefill')} -> {opts.kv_layout_of('decode')}"
             if opts.kv_layout else opts.head_layout)
    print(
        f"kvxfer demo: {opts.requests} requests x {opts.blocks_per_request} blocks "
        f"({mib:.1f} MiB each; {opts.layers} layers x {kv} x {opts.head_dim} {opts.dtype}, "
        f"blocks of {opts.block_size_of('prefill')} -> {opts.block_size_of('decode')} tokens, "
        f"{where}{', consecutive block ids' if opts.contiguous_blocks else ''}), "
        f"prefill TP {opts.prefill_tp} -> decode TP {opts.decode_tp}, "
        f"NIXL UCX ({opts.ucx_error_mode} mode) over host memory; {opts.window} in flight, "
        f"pools {(opts.pool_bytes('prefill') + opts.pool_bytes('decode')) / (1 << 30):.2f} GiB",
        flush=True,
    )
    res = run_demo(opts, start_method="spawn")  # (one run: a forkserver would import torch first)
    for problem in res["problems"]:
        print(f"  PROBLEM: {problem}")
    print(
        f"  moved   {res['requests']} requests, {res['bytes'] / (1 << 30):.3f} GiB in "
        f"{res['seconds']:.3f} s = {res['gbps']:.2f} GB/s (decode Recv -> Done, warm peer, "
        f"{res['rounds']} round{'' if res['rounds'] == 1 else 's'} of {res['in_flight']})"
    )
    print(f"  first   transfer with handshake (cold): {res['first_transfer_ms_cold']:.1f} ms")
    print(f"  descs   {res['descriptors_per_request']} NIXL descriptors per request (all decode ranks)")
    print(f"  release prefill holds released: {res['released']}")
    print(f"  verify  every byte of every block: {'OK' if res['verified'] else 'FAILED'}")
    if args.json:
        print(json.dumps({k: v for k, v in res.items() if k != "problems"} | {"problems": res["problems"]}))
    return 0 if res["verified"] else 1


# the sidecar's level -> (UCX_LOG_LEVEL, NIXL_LOG_LEVEL). UCX at "warn" prints its DIAG lines
# (measured: 3 at every exit, dozens when a peer leaves), so below DEBUG it logs errors only
NATIVE_LOG_LEVELS = {"DEBUG": ("diag", "DEBUG"), "INFO": ("error", "WARN"), "WARNING": ("error", "WARN"),
                     "ERROR": ("error", "ERROR"), "CRITICAL": ("fatal", "FATAL")}


def _bench_parser(sub: Any) -> None:
    b = sub.add_parser("bench", help="kvxfer vs raw NIXL vs memcpy, step overhead, first transfer")
    b.add_argument("--quick", action="store_true", help="small sizes, under a minute (CI smoke)")
    b.add_argument("--json", action="store_true", help="last line: one JSON object")
    b.add_argument("--kv-layout", choices=["LBNHC", "LBHNC", "BLNHC", "BLHNC"], default="LBNHC",
                   help="the KV cache layout of the main comparison (vLLM's names; BL...: block-outermost, "
                        "a block of every layer one run)")
    b.add_argument("--plot", metavar="PNG", help="write a plot (needs matplotlib)")
    b.add_argument("--ucx-error-mode", choices=["peer", "none"], default="peer")
    b.add_argument("--nixl-threads", type=int, default=Config.nixl_threads,
                   help="UCX backend worker threads, the same for the sidecars and the raw-NIXL "
                        "agents (default: the sidecar's, %(default)s; vLLM's NixlConnector uses 4)")
    b.add_argument("--device", default="auto",
                   help="where the KV caches live: cpu, cuda[:N] (VRAM over CUDA IPC) or auto "
                        "(the GPU when torch sees one)")
    b.add_argument("--tp-matrix", action="store_true",
                   help="instead: every prefill TP x decode TP pair (1, 2, 4, 8) per model and layout, "
                        "against 1 -> 1 and memcpy of the same bytes, every byte verified (~10 min; "
                        "--quick under a minute)")
    b.add_argument("--tp-pairs", metavar="P:D,...",
                   help="with --tp-matrix: these pairs (or 'all') for every model, 1:1 always added")
    b.add_argument("--layouts", metavar="KIND,...",
                   help="with --tp-matrix: the GQA models' layouts (LBNHC, LBHNC, BLNHC, BLHNC; default "
                        "LBNHC,LBHNC,BLHNC for 8 KV heads, LBNHC for 2)")
    b.add_argument("--tp-models", metavar="NAME,...",
                   help="with --tp-matrix: gqa8, gqa2, mla (default: all three)")
    b.add_argument("--rounds", type=int, default=0,
                   help="with --tp-matrix: timed rounds per cell (default 3, --quick 2)")


def _one_openmp_thread() -> None:
    """One OpenMP thread for torch's staging copies (kvxfer.sidecar.nixl_staging), on every
    thread from its first op: torch.set_num_threads(1) reaches only threads that had not yet
    run one, and an arena's warm-up on the NIXL thread ran one before it (with
    KVXFER_TEST_TORCH_COPIES on 2 cores, a staged read of one block: 17-24 ms, 2.7-2.9 with
    this). Set before the parsers load numpy (its OpenBLAS reads it at load); the operator's
    own value wins."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def _serve_check(config: Config, sources: dict[str, str]) -> int:
    """``kvxfer serve --check``: what the start would refuse (files, the secret, the engine
    socket's directory), then every field and where it came from."""
    from kvxfer.config import describe
    from kvxfer.errors import ListenError
    from kvxfer.sidecar.sockdir import check_private

    try:
        config.preflight()
        sock_dir = os.path.dirname(config.engine_socket.partition("ipc://")[2])
        if sock_dir and os.path.isdir(sock_dir):  # (one not there yet is made 0700)
            st = os.stat(sock_dir)
            if st.st_mode & 0o022:  # (others may write it: refused, as the start does)
                check_private(sock_dir, f"engine socket {config.engine_socket}")
            elif st.st_uid not in (0, os.geteuid()):  # (a unit's RuntimeDirectory: its User's)
                print(f"kvxfer: warning: {sock_dir} is owned by uid {st.st_uid}: only a sidecar running "
                      f"as that user may serve this socket", file=sys.stderr)
    except (ConfigError, ListenError) as e:
        print(f"kvxfer: {e}", file=sys.stderr)
        return 2
    print(describe(config, sources))
    return 0


def main(argv: list[str] | None = None) -> int:
    command = (sys.argv[1:] if argv is None else argv)[:1]
    if command == ["serve"]:
        _one_openmp_thread()
    parser = argparse.ArgumentParser(prog="kvxfer", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvxfer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the sidecar daemon")
    add_arguments(serve)
    _demo_parser(sub, full=command == ["demo"])
    from kvxfer.control.client_cli import add_commands

    add_commands(sub)
    _bench_parser(sub)
    args = parser.parse_args(argv)
    if hasattr(args, "func"):
        try:
            return int(args.func(args))
        except BrokenPipeError:  # (`kvxfer status --watch | head`: the reader went, no traceback)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (the exit's flush too)
            return 141
    if args.command == "bench" and args.tp_matrix:
        from kvxfer.testing.bench_tp import main as tp_main

        return tp_main(args)
    if args.command == "bench":
        from kvxfer.testing.bench import main as bench_main

        return bench_main(args)
    if args.command == "serve":
        flags = vars(args)
        check = flags.pop("check", False)
        sources: dict[str, str] = {}
        warnings: list[str] = []
        try:
            config = load_config(flags, sources=sources, warnings=warnings)
        except ConfigError as e:
            print(f"kvxfer: {e}", file=sys.stderr)
            return 2
        for w in warnings:
            print(f"kvxfer: warning: {w}", file=sys.stderr)
        if check:
            return _serve_check(config, sources)
        # UCX and NIXL log at the sidecar's level (set before NIXL loads; their own variables win)
        ucx, nixl = NATIVE_LOG_LEVELS[config.log_level.upper()]
        os.environ.setdefault("UCX_LOG_LEVEL", ucx)
        os.environ.setdefault("NIXL_LOG_LEVEL", nixl)
        from kvxfer.serve import run_server

        return run_server(config, reload=lambda: load_config(flags))
    return _run_demo(args)
