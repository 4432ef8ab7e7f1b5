"""The pipeline schedules' names and what each can do (``Schedule``), and the one home of the
schedule-name, stage, microbatch and virtual-stage checks. Data and arithmetic only: the schedules'
action lists are ``pipeline/schedule.py``'s."""

from __future__ import annotations

from ..arguments import Choice, check_choice, check_positive_int


class Schedule(Choice):
    """The four schedules, each knowing what it can do. The values are ``parallelize``'s
    ``schedule=`` strings, and a member equals its string, so callers may pass either."""

    ONE_F_ONE_B = "1f1b"
    GPIPE = "gpipe"
    INTERLEAVED_1F1B = "interleaved_1f1b"
    ZB_H1 = "zb_h1"

    @property
    def chunks(self) -> bool:
        """Runs several model chunks per rank (``virtual_stages`` > 1)."""
        return self is Schedule.INTERLEAVED_1F1B

    @property
    def split_backward(self) -> bool:
        """Splits each backward into B (input gradients) and a deferred W (weight gradients)."""
        return self is Schedule.ZB_H1

    @property
    def idle_below_pp(self) -> bool:
        """Fewer microbatches than stages leave most of each stage's step idle (nothing fills it)."""
        return self in (Schedule.ONE_F_ONE_B, Schedule.GPIPE)


SCHEDULES = Schedule.values()


def as_schedule(name: str | Schedule) -> Schedule:
    """``name`` as a ``Schedule``, refused with the list of names when it is none of them."""
    check_choice("schedule", name, SCHEDULES)
    return Schedule(name)


def interleaved_rounds(*, stages: int, microbatches: int) -> int:
    # torch's and Megatron's interleaving: rounds of at least pp microbatches, so a round's first
    # backward reaches rank 0 only after that rank has run all its chunks' forwards of the round.
    return max(1, microbatches // stages)


def microbatches_allowed(*, schedule: str, stages: int, microbatches: int) -> bool:
    """Whether ``schedule`` can run ``microbatches`` at pp=``stages``: interleaved_1f1b runs them in
    ``max(1, M // pp)`` rounds of equal size, so M must divide into them; every other schedule takes any M."""
    if not as_schedule(schedule).chunks:
        return True
    return microbatches % interleaved_rounds(stages=stages, microbatches=microbatches) == 0


def nearest_allowed_microbatches(*, schedule: str, stages: int, microbatches: int) -> tuple[int | None, int]:
    """The largest allowed count below ``microbatches`` (None if none) and the smallest above it."""
    below = next((m for m in range(microbatches - 1, 0, -1)
                  if microbatches_allowed(schedule=schedule, stages=stages, microbatches=m)), None)
    above = microbatches + 1  # terminates: every multiple of pp is allowed
    while not microbatches_allowed(schedule=schedule, stages=stages, microbatches=above):
        above += 1
    return below, above


def check_schedule_args(*, stages: int, microbatches: int, schedule: str, virtual_stages: int = 1) -> None:
    """The one home of the schedule-name, stage, microbatch and virtual-stage checks."""
    kind = as_schedule(schedule)
    check_positive_int("stages", stages)
    check_positive_int("microbatches", microbatches)
    check_positive_int("virtual_stages", virtual_stages)
    if not kind.chunks:
        if virtual_stages > 1:
            raise ValueError(f"virtual_stages={virtual_stages} needs schedule='interleaved_1f1b' (schedule="
                             f"{schedule!r} runs one chunk per rank); use virtual_stages=1 or 'interleaved_1f1b'")
        return
    if stages < 2:
        raise ValueError(f"schedule='interleaved_1f1b' needs pp >= 2, got pp={stages}; use '1f1b' at pp=1")
    if virtual_stages < 2:
        raise ValueError("schedule='interleaved_1f1b' needs virtual_stages >= 2, got 1; "
                         "virtual_stages=1 is schedule='1f1b'")
    if not microbatches_allowed(schedule=schedule, stages=stages, microbatches=microbatches):
        below, above = nearest_allowed_microbatches(schedule=schedule, stages=stages, microbatches=microbatches)
        rounds = interleaved_rounds(stages=stages, microbatches=microbatches)
        raise ValueError(
            f"microbatches={microbatches} is not allowed for interleaved_1f1b at pp={stages} (microbatches "
            f"run in max(1, M // pp) = {rounds} rounds of equal size): use {below} or {above}"
        )


