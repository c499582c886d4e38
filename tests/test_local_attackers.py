"""Attackers on the same host (#40, doors 3 and 4): another process of the engines' uid that
reaches the engine socket or the memory channel, run as a real separate process against
real sidecars, with every byte a peer reads checked.

Door 3, the engine socket: a connection may hold, release or receive only for an engine it
speaks for (``kvxfer.sidecar.ownership``: its process registered one of the engine's ranks or
is an ancestor of one, by the kernel's SO_PEERCRED, never by what a message claims). Door 4,
memory: a pool of the memory channel backs only registrations of the process that created it
and cannot be handed back by another connection while it is held; a legacy /dev/shm file
registers only when the registering process has that very file open or mapped. Another uid
cannot reach either socket at all.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvxfer.auth import new_token
from kvxfer.client import RemoteBlocks, SidecarClient
from kvxfer.errors import ErrorCode
from kvxfer.memchannel import mem_socket_path
from kvxfer.memory import SharedKV
from kvxfer.protocol import RegisterKV
from kvxfer.sidecar.ownership import Creds, Holder, why_not
from kvxfer.sidecar.procfs import has_open, holder, lineage, start_time
from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.procs import SidecarFactory

from .conftest import PD

NOBODY = 65534

# ----------------------------------------------------------------------------- the rule


def test_who_speaks_for_an_engine() -> None:
    sched, worker = 100, 101
    ranks = [Holder(Creds(worker, 1000), (worker, sched, 50)), Holder(Creds(102, 1000), (102, sched, 50))]
    assert why_not(Creds(worker, 1000), ranks) == ""  # a rank's own process (uniproc: the scheduler too)
    assert why_not(Creds(sched, 1000), ranks) == ""  # the scheduler: the workers' parent
    assert why_not(Creds(102, 1000), ranks) == ""  # a sibling rank's process: one of the engine's
    assert "neither a rank's process" in why_not(Creds(999, 1000), ranks)  # unrelated, same uid
    assert "uid 0" in why_not(Creds(sched, 0), ranks)  # the right pid under another uid: no
    assert why_not(Creds(999, 1000), ranks, "uid") == ""  # Ray: any process of the uid
    assert "uid" in why_not(Creds(999, 0), ranks, "uid")
    assert why_not(Creds(0, 1000), ranks) == ""  # invisible here (another PID namespace): uid decides
    assert why_not(Creds(999, 1000), [Holder(Creds(0, 1000))]) == ""  # a rank we cannot see: uid
    assert "uid" in why_not(Creds(0, 0), ranks)
    assert why_not(Creds(999, 0), []) == ""  # nothing registered: nothing to protect


def test_a_recycled_ancestor_pid_does_not_speak_for_the_engine() -> None:
    """The scheduler exited and an unrelated process got its pid: it is not the scheduler."""
    sched, worker = 100, 101
    ranks = [Holder(Creds(worker, 1000, "5000"), (worker, sched, 50), ("5000", "4000", "10"))]
    assert why_not(Creds(sched, 1000, "4000"), ranks) == ""  # the scheduler itself
    assert "neither a rank's process" in why_not(Creds(sched, 1000, "9000"), ranks)  # its pid, later
    assert why_not(Creds(sched, 1000), ranks) == ""  # (its start unknown: the pid decides, as before)
    # the facts come from the kernel: this process and its ancestors, with their start times
    me = holder(Creds(os.getpid(), os.getuid(), start_time(os.getpid())))
    assert me.starts[0] == start_time(os.getpid()) != ""
    assert len(me.starts) == len(me.lineage)
    assert me.has_ancestor(Creds(os.getppid(), os.getuid(), start_time(os.getppid()))) or os.getppid() == 1


def test_the_kernel_facts() -> None:
    chain = lineage(os.getpid())
    assert chain[0] == os.getpid()
    assert os.getppid() in chain or os.getppid() == 1
    assert 1 not in chain[1:]
    assert lineage(0) == ()
    with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="kvxfer-t") as fh:
        st = os.stat(fh.name)
        assert has_open(os.getpid(), st.st_dev, st.st_ino)
        child = subprocess.Popen(["sleep", "30"])
        try:
            assert not has_open(child.pid, st.st_dev, st.st_ino)
        finally:
            child.kill()
            child.wait()
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:  # mapped, its fd closed: still the process's
        import mmap

        path = os.path.join(d, "kvxfer-m")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, 4096)
        mm = mmap.mmap(fd, 4096)
        os.close(fd)
        st = os.stat(path)
        try:
            assert has_open(os.getpid(), st.st_dev, st.st_ino)
        finally:
            mm.close()
        assert not has_open(os.getpid(), st.st_dev, st.st_ino)


# ----------------------------------------------------------------------------- the attacker

_ATTACKER = r"""
import json, os, socket, sys, time
what, args = sys.argv[1], json.loads(sys.argv[2])
out = {"pid": os.getpid(), "uid": os.getuid()}
import msgspec
from kvxfer.client import RemoteBlocks, SidecarClient
from kvxfer.protocol import RegisterKV
c = SidecarClient(args["endpoint"])
c.ping(30)
if what == "release":
    c.release(args["req"])
elif what == "hold":
    c.hold(args["req"], args["blocks"], token="the-attackers")
elif what == "recv":
    r = args["remote"]
    c.recv(args["req"], args["blocks"], RemoteBlocks(r["engine"], r["host"], r["port"], r["blocks"],
                                                     token=r["token"]), deadline_s=10)
elif what == "register":
    msg = msgspec.msgpack.decode(bytes.fromhex(args["msg"]), type=RegisterKV)
    c.register_nowait(msgspec.structs.replace(msg, engine_id="thief", pid=os.getpid()))
elif what == "adopt":
    from kvxfer.memchannel import PoolAdopt, _enc, _replies, memfd
    fd = memfd(args["size"])
    os.pwrite(fd, b"\xee" * args["size"], 0)  # the attacker's bytes
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(args["memory"])
    socket.send_fds(s, [_enc.encode(PoolAdopt(pool=args["pool"], size=args["size"]))], [fd])
    reply = _replies.decode(s.recv(4096))
    out["adopt"] = [type(reply).__name__, getattr(reply, "code", ""), getattr(reply, "message", "")]
got = c.wait_until(lambda a: bool(a.errors or a.done or a.failed or a.registered), 5.0)
out["errors"] = [[e.code, e.message] for e in got.errors]
out["done"] = [d.req_id for d in got.done]
out["failed"] = [[f.code, f.reason] for f in got.failed]
out["registered"] = [r.engine_id for r in got.registered]
print(json.dumps(out), flush=True)
if args.get("stay"):
    sys.stdin.readline()  # keep this connection (and what it adopted) until the test is done
"""


class Attacker:
    """A separate process of this uid, no kin of the engines', that does ``what`` and says
    what it got."""

    def __init__(self, what: str, **args: Any) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _ATTACKER, what, json.dumps(args)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the attacker ({what}) said nothing"
        self.out: dict[str, Any] = json.loads(line)

    def codes(self) -> list[str]:
        return [code for code, _ in self.out["errors"]]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def attack(what: str, **args: Any) -> Attacker:
    a = Attacker(what, **args)
    a.close()
    return a


def _remote(e: SyntheticEngine, blocks: list[int], token: str) -> RemoteBlocks:
    reg = e.registered
    assert reg is not None
    return RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, blocks, token=token)


def _read_and_verify(p: SyntheticEngine, d: SyntheticEngine, req: str, pb: list[int], token: str) -> None:
    db = d.allocate(len(pb))
    d.wipe(db)
    d.client.recv(req, db, _remote(p, pb, token))
    got = d.client.wait_until(lambda a: bool(a.done or a.failed), 20.0)
    assert [x.req_id for x in got.done] == [req], got
    assert d.verify(req, db), f"{req}: the decode did not get the prefill's bytes"


# ----------------------------------------------------------------------------- door 3: the engine socket


def test_a_release_from_another_process_ends_no_hold(pd: PD) -> None:
    pb = pd.p.allocate(4)
    pd.p.fill("victim-a", pb)
    token = new_token()
    pd.p.client.hold("victim-a", pb, token=token)
    pd.p.client.ping(10)  # held
    a = attack("release", endpoint=pd.prefill.endpoint, req="victim-a")
    assert a.codes() == [ErrorCode.UNAUTHORIZED], a.out
    assert "does not speak for it" in a.out["errors"][0][1]
    assert str(a.out["pid"]) in a.out["errors"][0][1]
    _read_and_verify(pd.p, pd.d, "victim-a", pb, token)  # the hold is still there
    released = pd.p.client.wait_until(lambda x: bool(x.released), 10.0).released
    assert [(r.req_id, r.reason) for r in released] == [("victim-a", "read")]


def test_a_hold_from_another_process_is_refused(pd: PD) -> None:
    pb = pd.p.allocate(2)
    a = attack("hold", endpoint=pd.prefill.endpoint, req="evil-b", blocks=pb)
    assert a.codes() == [ErrorCode.UNAUTHORIZED], a.out
    # nothing was held: a read presenting the attacker's token gets nothing
    db = pd.d.allocate(2)
    pd.d.client.recv("evil-b", db, _remote(pd.p, pb, "the-attackers"), deadline_s=3)
    got = pd.d.client.wait_until(lambda x: bool(x.done or x.failed), 20.0)
    assert not got.done, got
    assert got.failed, got


def test_a_receive_from_another_process_writes_nothing_into_the_engines_blocks(pd: PD) -> None:
    pb = pd.p.allocate(3)
    pd.p.fill("victim-c", pb)
    token = new_token()
    pd.p.client.hold("victim-c", pb, token=token, lease_s=60)
    pd.p.client.ping(10)
    db = pd.d.allocate(3)
    pd.d.wipe(db)
    reg = pd.p.registered
    assert reg is not None
    a = attack("recv", endpoint=pd.decode.endpoint, req="evil-c", blocks=db,
               remote={"engine": reg.engine_id, "host": reg.handshake_host, "port": reg.handshake_port,
                       "blocks": pb, "token": token})
    assert a.codes() == [ErrorCode.UNAUTHORIZED], a.out
    assert not a.out["done"]
    assert pd.d.kv is not None
    assert not pd.d.kv.blocks()[:, :, db, :].any(), "the decode's blocks were written"
    _read_and_verify(pd.p, pd.d, "victim-c", pb, token)  # its own receive still works


# ----------------------------------------------------------------------------- door 4: memory

LAYOUT = make_layout(layers=2, num_blocks=32, heads=2, head_dim=32)


def test_a_pool_is_handed_back_only_by_its_holder(factory: SidecarFactory) -> None:
    ps, ds = factory.start("ad-p", "--lease-s", "30"), factory.start("ad-d")
    p, d = SyntheticEngine(LAYOUT, ps.endpoint, seed=1), SyntheticEngine(LAYOUT, ds.endpoint, seed=2)
    a = None
    try:
        p.start()
        d.start()
        assert p.pools is not None
        assert p.kv is not None
        pool = next(iter(p.pools.pools.values()))
        a = Attacker("adopt", endpoint=ps.endpoint, memory=mem_socket_path(ps.endpoint), pool=pool.id,
                     size=pool.size, stay=True)
        assert a.out["adopt"][:2] == ["PoolRefused", ErrorCode.UNAUTHORIZED], a.out
        # the victim registers its memory again (as after a reconnect): peers read its bytes
        p.client.register(p.kv.register_message(), 30)
        pb = p.allocate(4)
        p.fill("victim-d", pb)
        token = new_token()
        p.client.hold("victim-d", pb, token=token)
        _read_and_verify(p, d, "victim-d", pb, token)
    finally:
        if a is not None:
            a.close()
        p.close()
        d.close()


def test_a_registration_naming_another_processs_pool_is_refused(factory: SidecarFactory) -> None:
    sc = factory.start("pool-e")
    victim = SyntheticEngine(LAYOUT, sc.endpoint)
    try:
        victim.start()
        assert victim.kv is not None
        msg = victim.kv.register_message()
        a = attack("register", endpoint=sc.endpoint, msg=msgspec.msgpack.encode(msg).hex())
        assert not a.out["registered"], a.out
        assert a.codes() == [ErrorCode.INVALID_MEMORY], a.out
        assert "belongs to another process" in a.out["errors"][0][1]
    finally:
        victim.close()


def test_a_legacy_file_registers_only_from_the_process_that_has_it(factory: SidecarFactory) -> None:
    sc = factory.start("shm-f")
    kv = SharedKV.create(LAYOUT)  # no pools: a named 0600 file, open in this process only
    client = SidecarClient(sc.endpoint)
    try:
        client.ping(30)
        msg: RegisterKV = kv.register_message()
        a = attack("register", endpoint=sc.endpoint, msg=msgspec.msgpack.encode(msg).hex())
        assert not a.out["registered"], a.out
        assert a.codes() == [ErrorCode.INVALID_MEMORY], a.out
        assert "neither open nor mapped" in a.out["errors"][0][1]
        reg = client.register(msgspec.structs.replace(msg, pid=os.getpid()), 30)  # its owner can
        assert reg.bytes_registered == kv.nbytes
    finally:
        client.close()
        kv.close()


# ----------------------------------------------------------------------------- another uid


def _connect_as(uid: int, paths: dict[str, tuple[str, int]]) -> dict[str, str]:
    """Fork a child that becomes ``uid`` (the interpreter itself may be unreadable to it) and
    tries to connect to each unix socket; what each attempt raised, or "connected"."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no ZMQ, no threads, only the socket calls
        out = {}
        try:
            os.setgid(uid)
            os.setuid(uid)
            for name, (path, kind) in paths.items():
                s = socket.socket(socket.AF_UNIX, kind)
                try:
                    s.connect(path)
                    out[name] = "connected"
                except OSError as e:
                    out[name] = type(e).__name__
                s.close()
            out["uid"] = str(os.getuid())
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as fh:
        data = fh.read()
    os.waitpid(pid, 0)
    return json.loads(data)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another uid")
def test_another_uid_cannot_reach_either_socket(factory: SidecarFactory) -> None:
    sc = factory.start("uid-g")
    probe = SidecarClient(sc.endpoint)
    try:
        probe.ping(30)  # listening
    finally:
        probe.close()
    engine = sc.endpoint[len("ipc://"):]
    got = _connect_as(NOBODY, {"engine": (engine, socket.SOCK_STREAM),
                               "memory": (mem_socket_path(sc.endpoint), socket.SOCK_SEQPACKET)})
    assert got == {"uid": str(NOBODY), "engine": "PermissionError", "memory": "PermissionError"}, got
    assert Path(engine).stat().st_mode & 0o077 == 0


def test_the_attackers_socket_credentials_are_its_own() -> None:
    """(What every check above rests on: SO_PEERCRED names the connecting process.)"""
    from kvxfer.sidecar.procfs import creds_of

    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        assert creds_of(a) == Creds(os.getpid(), os.getuid(), start_time(os.getpid()))
        assert creds_of(a).start  # (its start time, so a recycled pid is not taken for it)


def test_the_engine_socket_reads_a_connections_process_once_and_forgets_it_when_it_closes(
        tmp_path: Path) -> None:
    """Credentials are kept per identity while it arrives on the same fd, and dropped when
    that fd's connection closes (its number may come back with another process behind it)."""
    import asyncio

    import zmq
    import zmq.asyncio

    from kvxfer.observe import Observer
    from kvxfer.protocol import Ping, encode
    from kvxfer.sidecar.engine_server import EngineServer

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        server = EngineServer(ctx, f"ipc://{tmp_path}/e.sock", Observer())
        server.bind()
        seen: list[Creds] = []
        server.on(Ping, lambda ident, msg: seen.append(server.sender))
        task = asyncio.ensure_future(server.serve())
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, b"w-test")
        dealer.connect(server.endpoint)
        try:
            for _ in range(3):
                await dealer.send(encode(Ping(seq=1)))
            for _ in range(100):
                if len(seen) == 3:
                    break
                await asyncio.sleep(0.02)
            assert seen == [Creds(os.getpid(), os.getuid(), start_time(os.getpid()))] * 3
            assert list(server._senders) == [b"w-test"]
            dealer.close(0)
            for _ in range(250):
                if not server._senders:
                    break
                await asyncio.sleep(0.02)
            assert not server._senders, "a closed connection's credentials were kept"
        finally:
            dealer.close(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            server.close()
            ctx.term()

    asyncio.run(main())


# ----------------------------------------------------------------------------- liveness


def test_a_rank_lives_as_long_as_the_kernels_pid_not_the_one_it_claims() -> None:
    """The pid a RegisterKV carries is the engine's in its own PID namespace: another process
    here (in a container, pid 2 is a kernel thread on the host). The rank is watched by the
    kernel's pid of its connection; one in another namespace (pid 0) is not watched by pid."""
    import asyncio

    from kvxfer.protocol import RankInfo, RegisterKV
    from kvxfer.sidecar.registry import RankRegistry
    from kvxfer.testing.engine import make_layout

    class Memory:
        async def register(self, key: object, msg: RegisterKV, holder: object) -> RankInfo:
            return RankInfo(layout=msg.layout, regions=[])

        async def unregister(self, key: object) -> bool:
            return True

    async def run() -> None:
        reg = RankRegistry("e", Memory())
        lay = make_layout(layers=1, num_blocks=4, heads=1, head_dim=8)
        me = Creds(os.getpid(), os.getuid(), start_time(os.getpid()))
        entry, _ = await reg.register(RegisterKV(layout=lay, memory=[], regions=[], pid=2), b"a", Holder(me))
        assert entry.pid == os.getpid()  # not 2
        assert reg.dead() == []
        other_ns = Creds(0, os.getuid())
        entry, _ = await reg.register(RegisterKV(layout=lay, memory=[], regions=[], pid=4 * 10**6,
                                                 engine_id="ns"), b"b", Holder(other_ns))
        assert entry.pid == 0  # not watched by a pid that means nothing here
        assert reg.dead() == []  # (pid 4,000,000 is no process here: it would have looked dead)
        entry, _ = await reg.register(RegisterKV(layout=lay, memory=[], regions=[], pid=os.getppid(),
                                                 engine_id="tcp"), b"c", None)
        assert entry.pid == os.getppid()  # tcp://: no credentials, the message's pid is all there is

    asyncio.run(run())
