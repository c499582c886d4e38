"""Push mode, the prefill side of the connector (kvxfer.connector.push), with a recording
client and duck-typed requests: when a request is held streamed, with which blocks, and what
happens to its blocks when its lease ends early, it is preempted, or its transfer id is reused
(each rule found by review; each test fails without its rule)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from kvxfer.client import Drained
from kvxfer.connector.push import StreamedHolds
from kvxfer.connector.settings import ConnectorSettings
from kvxfer.connector.step import StepPlan

BS = 16
# a sidecar's Pong: it holds prompts (of one KV cache group) chunk by chunk
CHUNKS = SimpleNamespace(chunk_streams=True, grouped_chunks=False)


@dataclass
class Client:
    holds: list[tuple[str, list[int]]] = field(default_factory=list)
    releases: list[str] = field(default_factory=list)
    groups: list[tuple[list[list[int]] | None, int]] = field(default_factory=list)
    chunks: list[tuple[bool, bool]] = field(default_factory=list)  # (partial, extends) per hold

    def hold(self, req_id: str, blocks: list[int], *a: Any, **kw: Any) -> None:
        assert kw["streamed"] is True
        assert kw["token"] == req_id
        self.holds.append((req_id, list(blocks)))
        self.groups.append((kw.get("groups"), kw.get("num_tokens", 0)))
        self.chunks.append((kw.get("partial", False), kw.get("extends", False)))

    def release(self, req_id: str, **kw: Any) -> None:
        self.releases.append(req_id)


class Sidecar(Client):
    """A recording client that a connector's worker or scheduler drains: ``pending`` is what
    its next poll returns."""

    def __init__(self) -> None:
        super().__init__()
        self.pending = Drained()

    def heartbeat(self) -> None:
        pass

    def poll(self) -> Drained:
        out, self.pending = self.pending, Drained()
        return out


def request(rid: str, tid: str, prompt: int, computed: int = 0, status: str = "RUNNING") -> Any:
    return SimpleNamespace(request_id=rid, num_prompt_tokens=prompt, num_computed_tokens=computed,
                           kv_transfer_params={"do_remote_decode": True, "transfer_id": tid},
                           status=SimpleNamespace(name=status))


def holds() -> tuple[StreamedHolds, Client]:
    client = Client()
    return StreamedHolds(ConnectorSettings(mode="push"), client, 1, "P"), client  # type: ignore[arg-type]


def test_only_a_step_that_computes_the_whole_prompt_is_streamed_with_the_prompts_blocks() -> None:
    push, client = holds()
    r = request("r1", "t1", prompt=100)
    assert push.streams(r)
    push.allocated(r, [1, 2, 3, 4, 5, 6, 7], BS)  # a chunk of 97 tokens allocates all 7 blocks
    push.scheduled({"r1": 97}, None, StepPlan())
    assert client.holds == []  # (not the last chunk: its tail is not computed this step)
    r.num_computed_tokens = 97
    push.allocated(r, [1, 2, 3, 4, 5, 6, 7, 8], BS)  # (+ a lookahead block)
    plan = StepPlan()
    push.scheduled({"r1": 3}, None, plan)
    assert client.holds == [("t1", [1, 2, 3, 4, 5, 6, 7])]  # the prompt's 7 blocks, not the lookahead one
    assert plan.streamed == ["t1"]
    assert plan.names == {"t1": "r1"}


def test_a_lease_that_ends_before_vllm_finishes_the_request_is_held_back() -> None:
    push, _ = holds()
    r = request("r1", "t1", prompt=20)
    push.allocated(r, [1, 2], BS)
    push.scheduled({"r1": 20}, None, StepPlan())
    # the decode read it while the prefill still decodes (max_tokens > 1): vLLM would assert
    assert push.hold_back({"r1", "other"}) == {"other"}
    r.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    assert push.finish(r) == (False, None)  # freed at once: its lease is over


def test_a_finished_request_keeps_its_blocks_until_released_and_an_aborted_one_is_released() -> None:
    push, client = holds()
    a, b = request("a", "ta", prompt=20), request("b", "tb", prompt=20)
    for r in (a, b):
        push.allocated(r, [1, 2], BS)
    push.scheduled({"a": 20, "b": 20}, None, StepPlan())
    a.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    b.status = SimpleNamespace(name="FINISHED_ABORTED")
    assert push.finish(a) == (True, None)
    assert push.finish(b) == (True, None)
    assert client.releases == ["tb"]
    assert push.hold_back({"a", "b"}) == {"a", "b"}  # (finished: their sends are reported)


def test_a_transfer_id_already_live_is_not_streamed_again() -> None:
    push, client = holds()
    for rid in ("r1", "r2"):
        push.allocated(request(rid, "same", prompt=20), [1, 2], BS)
    push.scheduled({"r1": 20, "r2": 20}, None, StepPlan())
    assert [h[0] for h in client.holds] == ["same"]
    assert push.held("r1")
    assert not push.held("r2")


def test_a_preempted_streamed_request_is_released_and_not_streamed_again() -> None:
    push, client = holds()
    r = request("r1", "t1", prompt=20)
    push.allocated(r, [1, 2], BS)
    push.scheduled({"r1": 20}, None, StepPlan())
    push.scheduled({}, {"r1"}, StepPlan())  # vLLM freed its blocks
    assert client.releases == ["t1"]
    push.allocated(r, [5, 6], BS)
    push.scheduled({"r1": 20}, None, StepPlan())
    assert len(client.holds) == 1  # (not held again)
    r.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    assert push.finish(r) == (False, None)


def test_a_model_of_several_groups_is_held_with_its_lists_as_vllm_will_finish_them() -> None:
    """A hybrid model (push, #36): one list per vLLM group, as ``request_finished`` will get
    them once the prompt is computed: attention groups cut to the prompt's blocks (never a
    lookahead block), the blocks vLLM then frees outside the window nulled (never held: it
    reuses them), a window's tail, the state's one block; the hold names them and the tokens."""
    from kvxfer.connector.groups import Group, Groups

    kinds = (Group("full", BS), Group("sliding_window", BS, window=20), Group("state", BS))
    groups = Groups(kinds, (0, 1, 2), 3)
    push, client = holds()
    push.groups = groups
    r = request("r1", "t1", prompt=100)  # 7 blocks of 16
    raw = [[1, 2, 3, 4, 5, 6, 7, 8], [11, 12, 13, 14, 15, 16, 17, 18], [21]]
    lists = groups.at_finish(raw, 100)
    # window: tokens 0-80 fall out of the window of token 100 (100 - 20 + 1 = 81): blocks 0-4
    # freed by vLLM; the tail of cdiv(20, 16) + 1 = 3 of the prompt's 7 blocks
    assert lists == [[1, 2, 3, 4, 5, 6, 7], [0, 16, 17], [21]]
    push.allocated_groups(r, raw)
    push.scheduled({"r1": 100}, None, StepPlan())
    assert client.groups == [(lists, 100)]
    assert client.holds == [("t1", [1, 2, 3, 4, 5, 6, 7, 16, 17, 21])]
    # the same lists as pull's request_finished gets from vLLM once it freed those blocks
    assert groups.clip([[1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 0, 0, 16, 17], [21]]) == lists


def test_layer_reports_count_tensors_whose_every_layer_is_computed_and_the_state_last() -> None:
    """What a prefill worker reports (push, ``LayerReports``): the first n KV tensors all of
    whose layers are computed, in the model's order, whatever layers vLLM names; a hybrid
    tensor is shared by one layer of each group; a state only when the forward is over."""
    from kvxfer.connector.layer_reports import LayerReports

    one = LayerReports({f"model.layers.{i}.attn": i for i in range(4)})
    step = object()
    assert one.computed("model.layers.0.attn", step) == 1
    assert one.computed("model.layers.2.attn", step) == 3  # (layer 1 not named: computed before 2)
    assert one.computed("model.layers.1.attn", step) is None  # (nothing new)
    assert one.computed("", step) == 4
    assert one.computed("model.layers.0.attn", object()) == 1  # (a new step starts at 0)
    # 6 layers, 2 groups: tensor 0 holds layers 0 and 3, tensor 1 layers 1 and 4, tensor 2 2 and 5
    hybrid = LayerReports({f"model.layers.{i}.attn": i % 3 for i in range(6)}, state=True)
    assert (hybrid.tensors, hybrid.total) == (3, 4)
    step = object()
    assert [hybrid.computed(f"model.layers.{i}.attn", step) for i in range(6)] == [None, None, None, 1, 2, 3]
    assert hybrid.computed("", step) == 4  # the state: only now
    assert hybrid.computed("mamba.7", object()) is None  # (not an attention layer: nothing)
    # two attention modules in one decoder layer (one number): naming one proves nothing of the other
    twin = LayerReports({"model.layers.0.attn": 0, "model.layers.0.cross": 1, "model.layers.1.attn": 2})
    step = object()
    assert twin.computed("model.layers.0.attn", step) == 1
    assert twin.computed("model.layers.1.attn", step) == 3  # (layer 0's modules are all before it)


def test_a_prompt_computed_in_chunks_is_held_chunk_by_chunk() -> None:
    """Push of a prompt vLLM computes in chunks (the sidecar's Pong says it holds them so): its
    first chunk's blocks held ``partial`` when it is scheduled, each next chunk's added
    (``extends``, from vLLM's ``scheduled_cached_reqs``, never a lookahead block); the
    workers report a chunk's blocks computed whole (``chunks``), the last chunk's layers one by
    one (``streamed``)."""
    client = Client()
    push = StreamedHolds(ConnectorSettings(mode="push"), client, 1, "P", CHUNKS)  # type: ignore[arg-type]
    r = request("r1", "t1", prompt=150)  # 10 blocks of 16, computed 64 tokens a step
    push.allocated(r, [1, 2, 3, 4], BS)
    plan = StepPlan()
    push.scheduled({"r1": 64}, None, plan)
    assert client.holds == [("t1", [1, 2, 3, 4])]
    assert client.chunks == [(True, False)]
    assert (plan.chunks, plan.streamed, plan.holds.keys()) == ({"t1": 4}, [], {"t1"})
    for computed, new, blocks, last in ((64, [5, 6, 7, 8], 8, False), (128, [9, 10, 11], 10, True)):
        r.num_computed_tokens = computed
        plan = StepPlan()
        cached = SimpleNamespace(req_ids=["x", "r1"], new_block_ids=[None, (new,)])
        push.scheduled({"x": 1, "r1": min(64, 150 - computed)}, None, plan, cached)
        assert client.holds[-1] == ("t1", list(range(1, blocks + 1)))  # (not the lookahead 11)
        assert client.chunks[-1] == (not last, True)
        assert plan.chunks == ({} if last else {"t1": 8})
        assert plan.streamed == (["t1"] if last else [])
    assert push.held("r1")
    # without the sidecar's say-so (an older one): held only at the step that computes it all
    old = Client()
    push = StreamedHolds(ConnectorSettings(mode="push"), old, 1, "P")  # type: ignore[arg-type]
    push.allocated(request("r2", "t2", prompt=150), [1, 2, 3, 4], BS)
    push.scheduled({"r2": 64}, None, StepPlan())
    assert old.holds == []


def test_a_hybrid_prompt_computed_in_chunks_holds_its_full_attention_groups_chunk_by_chunk() -> None:
    """Push of a hybrid prompt vLLM computes in chunks (the sidecar's Pong says it holds them
    so): each earlier chunk holds only its full-attention groups' blocks so far (vLLM keeps
    them until the request ends), with a window's and a state's lists empty (vLLM frees window
    blocks as the prompt moves on; a state is whole only at the end); the last chunk holds the
    lists ``request_finished`` will get (``at_finish``)."""
    from kvxfer.connector.groups import Group, Groups

    groups = Groups((Group("full", BS), Group("sliding_window", BS, window=20), Group("state", BS)),
                    (0, 1, 2), 3)
    client = Client()
    push = StreamedHolds(ConnectorSettings(mode="push"), client, 1, "P",  # type: ignore[arg-type]
                         SimpleNamespace(chunk_streams=True, grouped_chunks=True))
    push.groups = groups
    r = request("r1", "t1", prompt=150)  # 10 blocks of 16, computed 64 tokens a step
    push.allocated_groups(r, [[1, 2, 3, 4], [11, 12, 13, 14], [21]])
    plan = StepPlan()
    push.scheduled({"r1": 64}, None, plan)
    assert client.holds == [("t1", [1, 2, 3, 4])]
    assert client.groups == [([[1, 2, 3, 4], [], []], 150)]
    assert client.chunks == [(True, False)]
    assert (plan.chunks, plan.streamed) == ({"t1": 4}, [])
    r.num_computed_tokens = 64
    plan = StepPlan()
    push.scheduled({"r1": 64}, None, plan, SimpleNamespace(req_ids=["r1"], new_block_ids=[
        ([5, 6, 7, 8], [15, 16, 17, 18], [])]))
    assert client.groups[-1] == ([list(range(1, 9)), [], []], 150)
    assert client.chunks[-1] == (True, True)
    assert (plan.chunks, plan.streamed) == ({"t1": 8}, [])
    r.num_computed_tokens = 128
    plan = StepPlan()
    push.scheduled({"r1": 22}, None, plan, SimpleNamespace(req_ids=["r1"], new_block_ids=[
        ([9, 10, 11], [19, 20, 30], [])]))
    # the prompt's 10 blocks (not the lookahead 11); the window's tail of 3 with the 8 blocks
    # vLLM frees by then (tokens before 150 - 20 + 1) nulled; the state's block
    final = [list(range(1, 11)), [0, 19, 20], [21]]
    assert client.groups[-1] == (final, 150)
    assert client.holds[-1] == ("t1", [*range(1, 11), 19, 20, 21])
    assert client.chunks[-1] == (False, True)
    assert (plan.chunks, plan.streamed) == ({}, ["t1"])
    # a sidecar that holds no grouped chunks: held only at the step that computes it all
    old = Client()
    push = StreamedHolds(ConnectorSettings(mode="push"), old, 1, "P", CHUNKS)  # type: ignore[arg-type]
    push.groups = groups
    push.allocated_groups(request("r2", "t2", prompt=150), [[1, 2, 3, 4], [11, 12, 13, 14], [21]])
    push.scheduled({"r2": 64}, None, StepPlan())
    assert old.holds == []


def test_a_resumed_prompt_held_anew_at_its_first_chunk_is_extended_at_its_next() -> None:
    """A hybrid prompt whose first hold was not sent (its sidecar's queue full) is preempted and
    resumed: vLLM allocates it anew and it is held at that step's chunk; the same step's
    resumed ids (forgetting its old lists) must not drop the new hold's (found by review: its
    next chunks never extended it, and the decode waited for its deadline), nor its new block
    ids (all of them, for a resumed request) extend the hold they started (each twice)."""
    from kvxfer.client import SidecarUnavailable
    from kvxfer.connector.groups import Group, Groups

    class Flaky(Client):
        def hold(self, req_id: str, blocks: list[int], *a: Any, **kw: Any) -> None:
            if not self.holds and not getattr(self, "failed", False):
                self.failed = True
                raise SidecarUnavailable("queue full (test)")
            super().hold(req_id, blocks, *a, **kw)

    client = Flaky()
    push = StreamedHolds(ConnectorSettings(mode="push"), client, 1, "P",  # type: ignore[arg-type]
                         SimpleNamespace(chunk_streams=True, grouped_chunks=True))
    push.groups = Groups((Group("full", BS), Group("sliding_window", BS, window=20)), (0, 1), 2)
    r = request("r1", "t1", prompt=150)
    push.allocated_groups(r, [[1, 2, 3, 4], [11, 12, 13, 14]])
    push.scheduled({"r1": 64}, None, StepPlan())
    assert client.holds == []  # (not sent)
    # preempted, resumed: allocated anew, scheduled with its id among the resumed ones
    push.allocated_groups(r, [[5, 6, 7, 8], [15, 16, 17, 18]])
    plan = StepPlan()
    push.scheduled({"r1": 64}, None, plan, SimpleNamespace(  # (a resumed request's new ids: all of them)
        req_ids=["r1"], new_block_ids=[([5, 6, 7, 8], [15, 16, 17, 18])], resumed_req_ids={"r1"}))
    assert client.holds == [("t1", [5, 6, 7, 8])]
    assert plan.chunks == {"t1": 4}
    r.num_computed_tokens = 64
    plan = StepPlan()
    push.scheduled({"r1": 64}, None, plan, SimpleNamespace(req_ids=["r1"], new_block_ids=[
        ([9, 10, 21, 22], [19, 20, 23, 24])]))
    assert client.groups[-1] == ([[5, 6, 7, 8, 9, 10, 21, 22], []], 150)  # (extended)
    assert plan.chunks == {"t1": 8}


def test_a_chunked_prompt_whose_lease_ended_is_extended_no_more() -> None:
    """The lease of a prompt held chunk by chunk ends while vLLM still computes it (its decode
    gave up; found by review): the next chunks send no extension and re-arm no deadline (an
    orphan engine-side hold would be freed again later, under its transfer id)."""
    client = Client()
    push = StreamedHolds(ConnectorSettings(mode="push"), client, 1, "P", CHUNKS)  # type: ignore[arg-type]
    r = request("r1", "t1", prompt=150)
    push.allocated(r, [1, 2, 3, 4], BS)
    push.scheduled({"r1": 64}, None, StepPlan())
    assert push.hold_back({"r1"}) == set()  # (its Released came: kept until vLLM finishes it)
    r.num_computed_tokens = 64
    plan = StepPlan()
    push.scheduled({"r1": 64}, None, plan, SimpleNamespace(req_ids=["r1"], new_block_ids=[([5, 6, 7, 8],)]))
    assert len(client.holds) == 1
    assert (plan.holds, plan.chunks) == ({}, {})


def test_a_worker_does_not_hold_again_a_lease_that_ended_before_its_extension_was_bound() -> None:
    """With asynchronous scheduling the next chunk's extension is sent before the worker has
    reported the step in which the lease ended. The worker used to hold it again on binding
    that extension: no Released ever ended it, and at the next sidecar restart it was reported
    as a finished send for a request vLLM had already freed, which vLLM's scheduler asserts on
    (the engine core dies; found by a review)."""
    from kvxfer.connector.worker import TransferResults, WorkerSide
    from kvxfer.protocol import Released

    client = Sidecar()
    push = StreamedHolds(ConnectorSettings(mode="push"), client, 1, "P", CHUNKS)  # type: ignore[arg-type]
    worker = WorkerSide(ConnectorSettings(mode="push"), 0, 1, "cpu")
    worker.client = client  # type: ignore[assignment]
    worker._last_pong = float("inf")  # (a live sidecar)
    r = request("r1", "t1", prompt=64)
    push.allocated(r, [1, 2], BS)
    first = StepPlan()
    push.scheduled({"r1": 32}, None, first)  # step N: the first chunk, held partial
    worker.bind(first.recvs, first.holds, names=first.names, extended=first.extended)
    r.num_computed_tokens = 32
    second = StepPlan()  # step N + 1 scheduled before step N is reported: the last chunk extends it
    push.scheduled({"r1": 32}, None, second, SimpleNamespace(req_ids=["r1"], new_block_ids=[([3, 4],)]))
    assert second.extended == ["t1"]
    client.pending.released.append(Released(req_id="t1", reason="aborted"))  # the decode gave up
    assert worker.get_transfer_results().finished_sending == {"r1"}
    assert push.hold_back({"r1"}) == set()  # (held back: vLLM frees it when it finishes)
    worker.bind(second.recvs, second.holds, names=second.names, extended=second.extended)
    assert "t1" not in worker._holds, "a lease that ended is held again: no Released will end it"
    r.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
    assert push.finish(r) == (False, None)  # vLLM frees r1 now
    restart = TransferResults()
    worker._give_up(restart, 0.0)  # the sidecar restarts: what the worker still holds is freed
    assert not push.hold_back(set(restart.finished_sending)), "a finished send for a request vLLM freed"


def test_a_sidecar_rolled_back_under_the_engine_is_followed_by_its_last_pong() -> None:
    """The connector read the sidecar's push flags from its first Pong only: a sidecar
    restarted at an older version (no chunk-by-chunk or grouped holds) then got partial holds
    it cannot take. ``SchedulerSide`` now takes them from every Pong it drains (a restarted
    sidecar's, a heartbeat's answer): a new prompt in chunks is not held by chunk (it is held
    when vLLM finishes it, request-level push), and push loads are no longer grouped; a newer
    one turns them on again. A prompt held chunk by chunk when the sidecar restarted is not
    extended at its next chunk: its lease died with the old sidecar (an older one would take
    the extension for a new hold of part of the prompt)."""
    from kvxfer.connector.scheduler import SchedulerSide
    from kvxfer.protocol import Pong

    def pong(new: bool, instance: str = "a") -> Pong:
        return Pong(seq=0, engine_id="P", version=6, handshake_host="127.0.0.1", handshake_port=1,
                    instance=instance, grouped_streams=new, chunk_streams=new, grouped_chunks=new)

    class Pinged(Sidecar):
        def ping(self, _timeout: float) -> Pong:
            return pong(True)

    client = Pinged()
    side = SchedulerSide(ConnectorSettings(sidecar="ipc:///nowhere", mode="push"), 1, client)  # type: ignore[arg-type]
    assert (side.grouped_push, side.push.chunks, side.push.grouped_chunks) == (True, True, True)
    client.pending.pongs.append(pong(False))  # restarted, an older version
    side.take_plan()
    assert (side.grouped_push, side.push.chunks, side.push.grouped_chunks) == (False, False, False)
    side.push.allocated(request("r1", "t1", prompt=150), [1, 2, 3, 4], BS)
    side.push.scheduled({"r1": 64}, None, StepPlan())
    assert client.holds == []  # (no partial hold for a sidecar that cannot take one)
    client.pending.pongs.append(pong(True))
    side.take_plan()
    assert (side.grouped_push, side.push.chunks, side.push.grouped_chunks) == (True, True, True)
    r2 = request("r2", "t2", prompt=150)  # held chunk by chunk, then the sidecar restarts
    side.push.allocated(r2, [1, 2, 3, 4], BS)
    side.push.scheduled({"r2": 64}, None, StepPlan())
    assert client.chunks[-1] == (True, False)
    client.pending.pongs.append(pong(True, instance="b"))
    side.take_plan()
    r2.num_computed_tokens = 64
    sent = len(client.holds)
    cached = SimpleNamespace(req_ids=["r2"], new_block_ids=[([5, 6, 7, 8],)])
    side.push.scheduled({"r2": 64}, None, StepPlan(), cached)
    assert len(client.holds) == sent, "a lease of the old sidecar extended at the new one"
