"""How a Mamba/GDN state block splits over TP ranks (``KVLayout.state_parts``), from vLLM's
``MambaSpec`` of this rank: what lets the sidecars move state between different TP sizes.
Pure: shapes and sizes in, ``StatePart``s out; no vLLM or torch import (``connector.py``
reads the spec and vLLM's settings).

A state block of one layer holds the conv state, then the SSM/recurrent state (each view's
byte offset in the block is given, not assumed). vLLM shards both over TP:

- the conv state is ``[x | B | C]`` (Mamba2), ``[Q | K | V]`` (Gated DeltaNet) or ``[x]``
  (Mamba1) along its dim, each sub-projection split evenly over ranks (Mamba2's groups: or,
  with one group, replicated on every rank); laid out (dim, state) ("DS", rows of a channel
  contiguous: one run per sub-projection) or (state, dim) ("SD", vLLM's default: one run
  per sub-projection per state row);
- the SSM state's first dimension is heads (Mamba2, GDN's value heads) or channels (Mamba1).

Each part names its units (heads, groups, channels) for the whole model, so two ranks of any
TP sizes agree on what every byte is. vLLM's NixlConnector moves the conv state only in DS
layout and assumes groups split; this covers SD and a replicated group too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvxfer.protocol import StatePart

SPLITTABLE = ("mamba1", "mamba2", "gdn_attn")


@dataclass(frozen=True)
class StateSplit:
    """What a connector knows of its engine's state layers (vLLM's MambaSpec and settings) to
    say how their blocks split over TP ranks."""

    mamba_type: str
    shapes: tuple[tuple[int, ...], ...]  # per block, this rank's: the conv state, the SSM state
    itemsizes: tuple[int, ...]
    tp_size: int
    conv_dim_first: bool  # vLLM's conv state layout: (dim, state) "DS", else (state, dim) "SD"
    n_groups: int | None = None  # Mamba2's groups in the model's config
    dtypes: tuple[str, ...] = ()  # the states' dtype names (the signature tells fp16 from bf16)

    def signature(self) -> str:
        """What a prefill of another TP size must say in its kv_transfer_params for the decode
        to load its state (``remote_state_split``): the parts' model-wide shape (runs, units,
        bytes a unit) and dtypes, the same at any TP size; "" when the state does not split."""
        parts = self.parts()
        if not parts:
            return ""
        what = (self.mamba_type, tuple((p.count, p.units, p.unit_bytes) for p in parts), self.dtypes)
        return hashlib.sha256(repr(what).encode()).hexdigest()[:16]

    def parts(self, offsets: Sequence[int] | None = None) -> tuple[StatePart, ...]:
        """The parts of a block whose views start at ``offsets`` (default: back to back, as
        vLLM lays them out; the worker gives the offsets its tensors show)."""
        if offsets is None:
            offsets = (0, _size(self.shapes[0], self.itemsizes[0]) if self.shapes and self.itemsizes else 0)
        return state_parts(self.mamba_type, self.shapes, self.itemsizes, offsets, self.tp_size,
                           self.conv_dim_first, self.n_groups)


def _size(shape: Sequence[int], itemsize: int) -> int:
    n = itemsize
    for d in shape:
        n *= int(d)
    return n


def state_parts(mamba_type: str, shapes: Sequence[Sequence[int]], itemsizes: Sequence[int],
                offsets: Sequence[int], tp_size: int, conv_dim_first: bool,
                n_groups: int | None = None) -> tuple[StatePart, ...]:
    """The parts of one state block (``()``: a state kvxfer cannot split, which then moves only
    between equal TP sizes). ``shapes``/``itemsizes``/``offsets``: vLLM's conv state, then its
    SSM state (per block, this rank's), their item sizes and byte offsets in the block;
    ``n_groups``: Mamba2's groups in the model's config (needed only to tell one replicated
    group from one group per rank)."""
    kind = mamba_type.lower()
    if kind not in SPLITTABLE or len(shapes) != 2 or len(itemsizes) != 2 or len(offsets) != 2:
        return ()
    conv, ssm = (tuple(int(d) for d in s) for s in shapes)
    if len(conv) != 2:
        return ()
    dim, rows = conv if conv_dim_first else conv[::-1]
    dims = _sub_projections(kind, dim, ssm, tp_size, n_groups)
    if dims is None:
        return ()
    ci, si = itemsizes
    parts, at = [], 0
    for (local_units, unit_channels), units in dims:
        if conv_dim_first:  # (dim, state): a sub-projection's rows are one run
            parts.append(StatePart(offsets[0] + at * rows * ci, 1, 0, units, unit_channels * rows * ci))
        else:  # (state, dim): one run per state row
            parts.append(StatePart(offsets[0] + at * ci, rows, dim * ci, units, unit_channels * ci))
        at += local_units * unit_channels
    if at != dim:
        return ()
    parts.append(StatePart(offsets[1], 1, 0, ssm[0] * tp_size, _size(ssm[1:], si)))
    return tuple(parts)


def _sub_projections(kind: str, dim: int, ssm: tuple[int, ...], tp: int,
                     n_groups: int | None) -> list[tuple[tuple[int, int], int]] | None:
    """The conv dim's sub-projections: ((local units, channels per unit), model-wide units) each;
    None: the shapes do not decompose."""
    if kind == "mamba1":  # conv [x]: channels; SSM (channels, d_state)
        if len(ssm) != 2 or ssm[0] != dim:
            return None
        return [((dim, 1), dim * tp)]
    if len(ssm) != 3:
        return None
    if kind == "mamba2":  # conv [x | B | C]; SSM (heads, head_dim, d_state)
        heads, head_dim, d_state = ssm
        x = heads * head_dim
        rest = dim - x
        if rest <= 0 or rest % 2 or (rest // 2) % d_state:
            return None
        local_groups = rest // 2 // d_state
        if n_groups is not None:
            groups = n_groups
            if local_groups != (groups // tp if groups % tp == 0 else 1 if groups == 1 else -1):
                return None
        elif tp == 1 or local_groups > 1:
            groups = local_groups * tp
        else:
            return None  # one group here: one per rank, or the model's only one replicated?
        b = ((local_groups, d_state), groups)
        return [((heads, head_dim), heads * tp), b, b]
    # gdn_attn: conv [Q | K | V]; SSM (value heads, v_dim, k_dim)
    v_heads, v_dim, k_dim = ssm
    rest = dim - v_heads * v_dim
    if rest <= 0 or rest % 2 or (rest // 2) % k_dim:
        return None
    qk = ((rest // 2 // k_dim, k_dim), rest // 2 // k_dim * tp)
    return [qk, qk, ((v_heads, v_dim), v_heads * tp)]
