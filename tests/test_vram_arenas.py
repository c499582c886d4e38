"""Unit tests, with stand-ins for CUDA and NIXL, of what a GPU run found or a review of the
VRAM staging code did: an arena that cannot be made gives its VRAM back and is tried again,
and an engine's GPU is found by its UUID in the sidecar's own numbering. (What only a GPU
can show, the arenas moving bytes over cuda_ipc, is tests/test_gpu.py's.)"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvxfer.errors import ErrorCode, RequestError
from kvxfer.protocol import CudaIpcMemory
from kvxfer.sidecar import mapping
from kvxfer.sidecar import nixl_staging as ns


class _Agent:
    def __init__(self) -> None:
        self.refuse_vram = True
        self.registered: list[str] = []

    def register_memory(self, descs: list[Any], mem_type: str) -> tuple[str, str]:
        if mem_type == "VRAM" and self.refuse_vram:
            raise RuntimeError("NIXL_ERR_BACKEND")
        self.registered.append(mem_type)
        return ("reg", mem_type)

    def deregister_memory(self, reg: Any) -> None:
        self.registered.remove(reg[1])


def test_an_arena_that_cannot_be_made_gives_its_vram_back_and_is_tried_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An arena whose warm-up or registration failed used to keep its cuMemAlloc'ed VRAM
    (``DeviceBuffer`` has no finalizer: 1 GiB a device, for the sidecar's life: what every
    device lost on the H200 run), and its device was never tried again."""
    freed: list[int] = []

    class Buf:
        def close(self) -> None:
            freed.append(1)

    monkeypatch.setattr(ns, "_device_memory", lambda size, dev: (Buf(), torch.zeros(size, dtype=torch.uint8)))
    monkeypatch.setattr(torch.cuda, "Stream", lambda dev: None)  # (no stream: copies run in place)
    monkeypatch.setattr(ns, "arena_device", lambda info: 0)
    agent = _Agent()
    arenas = ns.Arenas(agent, 1 << 16, 1 << 16)
    assert arenas.for_rank(None) == arenas.spans()
    assert 0 not in arenas.spans()
    assert freed == [1]  # the failed arena's VRAM went back
    assert arenas.missing == {0}  # (kvxfer_staging_arenas_missing)
    agent.refuse_vram = False
    arenas.for_rank(None)
    assert 0 not in arenas.spans()  # not at once: a registration storm does not retry each time
    monkeypatch.setattr(ns, "ARENA_RETRY_S", 0.0)
    arenas.for_rank(None)
    assert 0 in arenas.spans()
    assert arenas.missing == set()
    assert agent.registered.count("VRAM") == 1
    arenas.close()
    assert freed == [1, 1]
    assert "VRAM" not in agent.registered


def test_an_engines_gpu_is_found_by_its_uuid_in_the_sidecars_numbering(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's ``cuda:0`` can be the sidecar's ``cuda:1`` (CUDA_VISIBLE_DEVICES, a
    device plugin): the CUDA IPC path used the engine's ordinal for the handle, NIXL and the
    arena."""
    uuids = ["5c3f1e2a-0000-1111-2222-333344445555", "9d8e7f60-aaaa-bbbb-cccc-ddddeeeeffff"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(uuids))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=uuids[i]))
    assert mapping.local_ordinal(0, uuids[1]) == 1
    assert mapping.local_ordinal(0, "GPU-" + uuids[1].upper()) == 1  # (as nvidia-smi prints it)
    assert mapping.local_ordinal(1, uuids[0]) == 0
    assert mapping.local_ordinal(3, "") == 3  # (an engine that sent none: its ordinal)
    opened: list[int] = []

    def open_handle(device: int, *args: Any) -> Any:
        opened.append(device)
        return SimpleNamespace(data_ptr=lambda: 0x7F0000000000)

    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", open_handle)
    ref = CudaIpcMemory(device_index=0, handle=b"h", size=1 << 20, offset=0, ref_counter_handle=b"r",
                        ref_counter_offset=0, event_handle=b"", event_sync_required=False,
                        device_uuid=uuids[1])
    m = mapping.map_memory(ref)
    assert opened == [1]  # the handle opened on the sidecar's GPU 1, not its GPU 0
    assert m.device_id == 1  # and so registered with NIXL, and staged through GPU 1's arena
    with pytest.raises(RequestError) as ei:
        mapping.local_ordinal(0, "0123abcd-0000-0000-0000-000000000000")
    assert ei.value.code == ErrorCode.INVALID_MEMORY
    assert "CUDA_VISIBLE_DEVICES" in str(ei.value)


def test_a_reader_moving_on_to_another_gpus_window_gives_its_last_slot_up() -> None:
    """The prefill's half of windows on several GPUs (a decode rank reading prefill ranks on
    GPUs 0 and 1): the reader's next window, asked of GPU 1's arena, frees its slot in GPU 0's
    (it read that window); it used to be kept until the slot's ttl, one per window."""
    import asyncio
    import types
    from unittest import mock

    import numpy as np

    from kvxfer.protocol import KVLayout, RankInfo, RemoteRegion, StageRank, StageRequest
    from kvxfer.sidecar.stage_server import StageServer

    async def run() -> list[tuple[int, int]]:
        async def gather(ranks: Any, blocks: Any, offset: int, nbytes: int, device: int) -> None:
            pass

        nixl = types.SimpleNamespace(spans={0: (1 << 30, 1 << 20), 1: (1 << 31, 1 << 20)}, gather=gather,
                                     expect_reads=lambda: None)
        holds = mock.MagicMock()
        holds.renew.return_value = types.SimpleNamespace(held=["held"])
        holds.lease_for.return_value = types.SimpleNamespace(engine="p", block_ids=[1, 2])

        def find(engine: str, pp: int, rank: int) -> Any:
            region = RemoteRegion(addr=0, block_len=8, block_stride=8, device_id=rank)  # (rank r on GPU r)
            info = RankInfo(layout=mock.MagicMock(spec=KVLayout), regions=[region], mem_type="VRAM")
            return types.SimpleNamespace(key=f"rank{rank}", info=info)

        registry = mock.MagicMock()
        registry.find.side_effect = find
        server = StageServer(holds=holds, registry=registry, nixl=nixl,  # type: ignore[arg-type]
                             generation=lambda: "g")
        runs = np.array([[0, 4096]], dtype="<i8").tobytes()
        slots = []
        for gpu in (0, 1, 1, 2):
            req = StageRequest(seq=1, engine_id="p", req_id="x", ranks=[StageRank(rank=gpu, runs=runs)],
                               nbytes=4096, readers=["0/0"], extend_s=5.0, agent_name="d", token="t")
            got = await server.answer(req)
            if gpu == 2:  # (no arena on GPU 2: asking again will not help, and the reader is told so)
                assert (got.held, got.code) == ("busy", ErrorCode.UNSUPPORTED), got
                continue
            assert got.held == "held", got
            slots.append((len(server.books.get(0) or ()), len(server.books.get(1) or ())))
        return slots

    assert asyncio.run(run()) == [(1, 0), (0, 1), (0, 1)]


def test_each_window_is_read_from_the_arena_of_its_prefill_gpu() -> None:
    """The decode's half: a receive in windows of one prefill GPU each reads every window's
    slot from that GPU's arena (``StagedRead.remote_device``), the last one included."""
    import asyncio
    import types
    from unittest import mock

    import numpy as np

    from kvxfer.config import Config
    from kvxfer.protocol import Recv, Staged
    from kvxfer.sidecar.staged_reads import Prepared, Staging
    from kvxfer.sidecar.staging import StagedPlan

    def plan() -> StagedPlan:
        return StagedPlan(10, [], np.empty((0, 3), np.int64), 0)

    msg = Recv(req_id="r1", block_ids=[3], remote_engine_id="p", remote_host="h", remote_port=9,
               remote_block_ids=[5])
    port = types.SimpleNamespace(spans={})
    st = Staging(Config(), mock.MagicMock(), mock.MagicMock(), port, "d")  # type: ignore[arg-type]
    st._ask = mock.AsyncMock(return_value=(Staged(seq=1, held="held", addr=4096, nbytes=10, ttl_s=5.0),
                                           1.0))  # type: ignore[method-assign]
    read_from: list[int] = []
    st._staged_read = lambda key, part, got, sent: read_from.append(part.remote_device)  # type: ignore
    prepared = Prepared(plan(), 0, [], expected=1, device=0, remote_device=1,
                        windows=((plan(), []), (plan(), [])), window_devices=(0, 1))
    windows = types.SimpleNamespace(key="k", check=lambda: None, read=mock.AsyncMock())
    got = asyncio.run(st.ask(msg, "p", prepared, 30.0, mock.MagicMock(), lambda m: None,
                             windows))  # type: ignore[arg-type]
    assert got[0] is not None
    assert read_from == [0, 1]  # the two windows read here; the last (GPU 1) is the receive's own
    assert [c.args[0][0].prepared.remote_device for c in st._ask.call_args_list] == [0, 1, 1]


def test_a_window_on_a_prefill_gpu_without_an_arena_sends_the_whole_read_directly() -> None:
    """A prefill GPU whose arena could not be made answers UNSUPPORTED: the receive reads
    everything directly at once (rewriting what earlier windows scattered), where it used to
    ask again for that window until its deadline and then fail."""
    import asyncio
    import time
    import types
    from unittest import mock

    import numpy as np

    from kvxfer.config import Config
    from kvxfer.protocol import Recv, Staged
    from kvxfer.sidecar.staged_reads import Prepared, Staging
    from kvxfer.sidecar.staged_windows import NoArena
    from kvxfer.sidecar.staging import StagedPlan

    def plan() -> StagedPlan:
        return StagedPlan(10, [], np.empty((0, 3), np.int64), 0)

    msg = Recv(req_id="r1", block_ids=[3], remote_engine_id="p", remote_host="h", remote_port=9,
               remote_block_ids=[5])
    st = Staging(Config(), mock.MagicMock(), mock.MagicMock(), types.SimpleNamespace(spans={}),  # type: ignore
                 "d")
    held = (Staged(seq=1, held="held", addr=4096, nbytes=10, ttl_s=5.0), 1.0)
    st._ask = mock.AsyncMock(side_effect=[held, NoArena("no arena")])  # type: ignore[method-assign]
    st._staged_read = lambda *a: None  # type: ignore[method-assign]
    prepared = Prepared(plan(), 0, [], expected=1, device=0, remote_device=1, windows=((plan(), []),),
                        window_devices=(0,))
    windows = types.SimpleNamespace(key="k", check=lambda: None, read=mock.AsyncMock())
    t0 = time.monotonic()
    got = asyncio.run(st.ask(msg, "p", prepared, 30.0, mock.MagicMock(), lambda m: None,
                             windows))  # type: ignore[arg-type]
    assert got == (None, 0.0)
    assert time.monotonic() - t0 < 5
    assert (st._ask.call_count, st.fell_back, st.staged) == (2, 1, 0)


def _rank(layout: Any, base: int, device: int) -> Any:
    from kvxfer.protocol import RankInfo, RemoteRegion

    bl, span = layout.region_block_len, layout.num_blocks * layout.region_block_len
    regions = [RemoteRegion(addr=base + i * span, block_len=bl, block_stride=bl, device_id=device)
               for i in range(layout.num_regions)]
    return RankInfo(layout=layout, regions=regions, mem_type="VRAM", engine_id="p")


@pytest.mark.parametrize(("gpus", "windows"), [((0, 1), 1), ((0, 0), 0)])
def test_a_read_of_prefill_ranks_on_two_gpus_is_prepared_in_windows_of_one_gpu_each(
        gpus: tuple[int, int], windows: int) -> None:
    """Staging.prepare for a TP=1 decode on GPU 0 reading a TP=2 prefill (NHD: every token's
    heads from both ranks): with the prefill ranks on GPUs 0 and 1 it used to return None (read
    directly, over tcp on a GPU); it is now one window from GPU 0's arena and the receive's
    own read from GPU 1's, together every byte of the plan; on one GPU, one slot as before."""
    import types
    from unittest import mock

    from kvxfer.config import Config
    from kvxfer.protocol import Recv
    from kvxfer.sidecar.receive import plan_read
    from kvxfer.sidecar.staged_reads import Staging
    from kvxfer.testing.engine import make_layout

    local = make_layout(layers=2, num_blocks=16, heads=8, head_dim=64)
    remote = {(0, k): _rank(make_layout(layers=2, num_blocks=16, heads=8, head_dim=64, tp_rank=k, tp_size=2),
                            (k + 1) << 32, gpus[k]) for k in (0, 1)}
    msg = Recv(req_id="r1", block_ids=[1, 2, 3], remote_engine_id="p", remote_host="h", remote_port=9,
               remote_block_ids=[4, 5, 6], remote_tp_size=2)
    plans, pairing = plan_read(msg, local, remote, "p")
    port = types.SimpleNamespace(spans={0: (1 << 40, 64 << 20)})
    st = Staging(Config(), mock.MagicMock(), mock.MagicMock(), port, "d")  # type: ignore[arg-type]
    peer = types.SimpleNamespace(staging_bytes=64 << 20, agent_name="p-agent", engine_ranks=lambda e: remote)
    prepared = st.prepare("k", msg, _rank(local, 1 << 36, 0), peer, "p", plans, pairing, 30.0)  # type: ignore
    assert prepared is not None
    assert len(prepared.windows) == windows
    assert prepared.window_devices == ((0,) if windows else ())
    assert prepared.remote_device == gpus[1]
    total = 3 * local.num_regions * local.region_block_len  # (3 blocks, every region, both halves)
    assert sum(w.nbytes for w, _ in prepared.windows) + prepared.plan.nbytes == total
    asked = [{r.rank for r in ranks} for _, ranks in prepared.windows] + [{r.rank for r in prepared.ranks}]
    assert asked == ([{0}, {1}] if windows else [{0, 1}])


@pytest.mark.parametrize(("mem_type", "pieces"), [("DRAM", 40), ("VRAM", 2)])
def test_a_vram_slot_is_read_in_large_descriptors(mem_type: str, pieces: int) -> None:
    """A staged read's one leg covers the slot back to back: host slots in 2 MiB pieces (UCX's
    threads copy several at once), VRAM slots in 64 MiB ones (cuda_ipc: one device copy each;
    the H200 run's 512 descriptors of 2 MiB took 3.6 ms a GiB where one took 0.74)."""
    import numpy as np

    from kvxfer.sidecar.plan import StagedRead

    nbytes = (80 << 20) - 4096
    st = StagedRead(local_addr=1 << 30, remote_addr=3 << 30, nbytes=nbytes,
                    scatter=np.zeros((0, 3), np.int64), trust_until=0.0, mem_type=mem_type,
                    local_device=1, remote_device=2)
    leg = ns.staged_leg(st)
    local, remote = leg.plan.runs
    assert len(local) == pieces == leg.plan.chunk
    assert leg.plan.nbytes == int(local[:, 1].sum()) == int(remote[:, 1].sum()) == nbytes
    assert (local[:, 0] - st.local_addr == np.concatenate(([0], np.cumsum(local[:-1, 1])))).all()
    assert (remote[:, 0] - st.remote_addr == local[:, 0] - st.local_addr).all()
    assert set(local[:, 2]) == {1}
    assert set(remote[:, 2]) == {2}
    assert leg.pair.local_mem == leg.pair.remote_mem == mem_type
