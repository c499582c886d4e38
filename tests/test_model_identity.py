"""Two models never exchange KV: the model's identity is part of the compatibility hash, and a
refusal names both models. (Same KV shape here: only the identity differs.)"""

from __future__ import annotations

import pytest

from kvxfer.client import RemoteBlocks
from kvxfer.errors import ErrorCode
from kvxfer.testing.engine import SyntheticEngine, make_layout
from kvxfer.testing.procs import SidecarFactory
from tests.test_sidecar import wait_for


@pytest.mark.parametrize(("p_model", "d_model", "ok"), [
    ("arch=LlamaForCausalLM;model=/m/a", "arch=LlamaForCausalLM;model=/m/a", True),
    ("arch=LlamaForCausalLM;model=/m/a", "arch=LlamaForCausalLM;model=/m/b", False),
    ("arch=Llama;model=/m/a;dtype=bfloat16", "arch=Llama;model=/m/a;dtype=float16", False),
])
def test_models_with_the_same_kv_shape_are_refused_by_identity(p_model: str, d_model: str, ok: bool) -> None:
    with SidecarFactory() as f:
        ps, ds = f.start("mp", "--handshake-timeout-s", "2"), f.start("md", "--handshake-timeout-s", "2")
        p = SyntheticEngine(make_layout(layers=2, num_blocks=16, heads=2, head_dim=16, model=p_model),
                            ps.endpoint, seed=1)
        d = SyntheticEngine(make_layout(layers=2, num_blocks=16, heads=2, head_dim=16, model=d_model),
                            ds.endpoint, seed=2)
        try:
            reg = p.start()
            d.start()
            p.fill("m1", [1, 2])
            p.client.hold("m1", [1, 2])
            where = RemoteBlocks(reg.engine_id, reg.handshake_host, reg.handshake_port, [1, 2])
            d.client.recv("m1", [3, 4], where)
            got = wait_for(d.client, lambda a: bool(a.done or a.failed))
            if ok:
                assert got.done
                assert d.verify("m1", [3, 4])
                return
            assert got.failed[0].code == ErrorCode.INCOMPATIBLE
            assert "different models" in got.failed[0].reason
            assert p_model in got.failed[0].reason
            assert d_model in got.failed[0].reason
        finally:
            p.close()
            d.close()


def test_the_connector_names_the_model(tmp_path: object) -> None:
    from kvxfer.connector.connector import model_identity
    from tests.vllm_harness import make_config, write_tiny_model

    model = write_tiny_model(str(tmp_path))
    ident = model_identity(make_config(model, "ipc:///tmp/none"))
    assert "arch=LlamaForCausalLM" in ident
    assert f"model={model}" in ident
    assert "dtype=float16" in ident
    assert model_identity(make_config(model, "ipc:///tmp/none"), "my-llama@v3") == "my-llama@v3"
