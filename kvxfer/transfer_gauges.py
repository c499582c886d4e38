"""Gauges of the transfer path, read by the metrics thread through functions the app hands
in (ints and lengths only, never an iteration of state another thread changes)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge


def staging_gauges(registry: CollectorRegistry, decode: Callable[[], dict[str, int]],
                   slots: Callable[[], int], arenas: Callable[[], tuple[int, int]],
                   answered: Callable[[], tuple[int, float, float]] = lambda: (0, 0.0, 0.0)) -> None:
    """Staged reads (#35, #39), for the metrics thread: ``kvxfer_staged_receives{how}``, the
    receives this sidecar staged in one slot, in windows (too large for one), or prepared
    and then read directly (the prefill had no room: on a GPU ~100x slower);
    ``kvxfer_staging_slots``, the slots this sidecar holds for readers of its arenas;
    ``arenas()``: (``kvxfer_staging_arena_bytes``, the arenas' bytes, host and VRAM,
    ``kvxfer_staging_arenas_missing``, CUDA devices with VRAM registered and no arena: every
    read of theirs goes directly, on a GPU over tcp); ``answered()``: the slots this sidecar
    answered, their seconds from request to answer and the gathers' part, summed."""
    g = Gauge("kvxfer_staged_receives", "Receives staged, by how: slot (one slot), windows (a read too "
              "large for one slot, or gathered on several GPUs of the prefill, in windows through one), "
              "direct (prepared, then read directly: the prefill had no room).", ["how"], registry=registry)
    for how in ("slot", "windows", "direct"):
        g.labels(how).set_function(lambda how=how: decode().get(how, 0))
    Gauge("kvxfer_staging_slots", "Staging slots this sidecar holds for its readers.",
          registry=registry).set_function(slots)
    Gauge("kvxfer_staging_arena_bytes", "Bytes of this sidecar's staging arenas (host and VRAM).",
          registry=registry).set_function(lambda: arenas()[0])
    Gauge("kvxfer_staging_arenas_missing", "CUDA devices with VRAM registered here and no staging arena "
          "(it could not be made: their reads go directly, slowly; tried again 30 s on).",
          registry=registry).set_function(lambda: arenas()[1])
    for i, (name, what) in enumerate((("answers", "Staging slots answered here (prefill), ever."),
                                      ("answer_seconds", "Seconds from a staging request's arrival to its "
                                       "slot's answer here, summed over every slot answered."),
                                      ("gather_seconds", "Of those, the gathers' (the copy into the slot, "
                                       "on the NIXL thread, and the hand-offs), summed."))):
        Gauge(f"kvxfer_staged_{name}", what, registry=registry).set_function(lambda i=i: answered()[i])


def read_path_gauges(registry: CollectorRegistry, counts: Callable[[], tuple[int, int, int]]) -> None:
    """How this sidecar's reads were posted and landed (#38), ``counts()``: (reads its event
    loop posted itself, reads whose data landed inside the call that posted them, fences
    posted: ``kvxfer.sidecar.nixl_fences``), each ever."""
    for i, (name, what) in enumerate((
            ("reads_posted_by_loop", "Reads this sidecar's event loop planned and posted itself, with no "
             "hand-off to the NIXL thread (--inline-read-kib), ever."),
            ("reads_landed_in_post", "Reads whose data landed inside the call that posted them (a small read "
             "on one host: no progress poll waited for), ever."),
            ("notice_fences", "Fences posted, ever: a 16-byte READ after each NIXL notification, so that the "
             "next read from that peer lands inside its post (--notice-fences)."))):
        Gauge(f"kvxfer_{name}", what, registry=registry).set_function(lambda i=i: counts()[i])
