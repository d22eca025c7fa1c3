"""Rolling a spec change through the worlds, a few at a time, each drained first.

`plan()` is pure: the worlds as the health loop sees them this round and the rollout's memory
(`status.rollout`) in, the orders for this round and the new memory out. The memory is what
makes a rollout resumable: which worlds are done, which are in flight and at which step, the
target it rolls to, and why it stopped if it did. Everything else is observed again every
round (a world is done when its pods run the new spec and it is Ready), so an operator killed
at any point neither skips nor repeats a world.

Per world, in flight:
- replace: `draining` (sleep, mode drain: the engine finishes what it admitted and its /ready
  drops it from the Service) → `replacing` (once parked, or when it does not answer) → done
  when the new pods are Ready;
- swap (only the model path or revision changed, and `rollout.inPlaceWeightSwap`): `swapping` =
  sleep level 2, then wakeup with the model path (read again) in the same processes → done when
  Ready on it.

At most `rollout.maxUnavailable` worlds are out of service at once, counting every world that
is not Ready for any reason but one: while the deployment is meant to sleep (`asleep`), a
sleeping world is where it should be, not out of service. So a rollout goes on while the worlds
sleep: each is replaced (or swapped) in turn, done when up on the new spec (Ready, or Sleeping
again), and the sleep intent puts it back to sleep. An outdated world that is down anyway
(never came up, failing) is replaced at once (it serves nothing). A world that fails its
rollout (Failed, or not Ready within the startup timeout) stops the rollout, naming it, instead
of taking the next world down.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from berth.operator.restarts import format_time, parse_time

Order = Literal["drain", "replace", "swap-sleep", "swap-wake", "wake"]


@dataclass(frozen=True)
class WorldState:
    index: int
    ready: bool
    phase: str
    admission: str | None
    # "launcher" / "worker": its pods run an outdated spec (replace); "model": only the model
    # path differs and in-place swaps are allowed (swap); None: current.
    outdated: str | None
    busy: bool  # a sleep / wakeup of this world is in flight
    idle: bool = False  # meant to sleep for idleness (spec.autoscaling): asleep is where it belongs


@dataclass
class Plan:
    orders: list[tuple[int, Order]] = field(default_factory=list)
    memory: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, str, str]] = field(default_factory=list)


ANSWERING = ("Ready", "NotReady", "Sleeping", "Waking")
# Worlds that serve nothing and are not about to (never up, failing): replacing them at once
# costs no availability. A world that is only Unreachable for a poll is not among them.
DOWN = ("Pending", "Starting", "Restarting", "BackingOff", "Failed")


def plan(
    worlds: list[WorldState],
    memory: Mapping[str, Any] | None,
    target: str,
    max_unavailable: int,
    now: dt.datetime,
    drain_timeout: float,
    startup_timeout: float,
    swap_refused: Mapping[int, str] | None = None,
    asleep: bool = False,
) -> Plan:
    """This round's orders. `swap_refused`: worlds whose engine refused the new revision now;
    `asleep`: the deployment's intent is that every world sleeps (manual or scheduled)."""

    def resting(world: WorldState) -> bool:
        return (asleep or world.idle) and world.phase == "Sleeping"

    def out_of_service(world: WorldState) -> bool:
        return not world.ready and not resting(world)

    memory = dict(memory or {})
    result = Plan()
    by_index = {world.index: world for world in worlds}
    outdated = {world.index for world in worlds if world.outdated}
    if memory.get("target") != target:
        # A new target: worlds half-way through keep going (they are outdated still), the
        # rest starts over; a stop for an older target no longer holds.
        kept = [entry for entry in memory.get("inFlight") or [] if entry["world"] in outdated]
        memory = {"target": target, "done": [], "inFlight": kept}
        if outdated:
            result.events.append(
                ("Normal", "RolloutStarted", f"rolling out to {target}: worlds {sorted(outdated)} to update")
            )
    done: list[int] = list(memory.get("done") or [])
    failed = memory.get("failed")
    in_flight: list[dict[str, Any]] = []

    for entry in memory.get("inFlight") or []:
        world = by_index.get(entry["world"])
        if world is None:
            continue  # scaled away
        index, step = world.index, entry["step"]
        refused = (swap_refused or {}).get(index)
        if refused is not None:
            failed = {"world": index, "message": f"the engine refused the new model: {refused}"}
            result.events.append(("Warning", "RolloutFailed", f"world {index}: {failed['message']}"))
            result.orders.append((index, "wake"))  # back to serving the weights it had
            continue
        if not world.outdated:
            if world.ready or resting(world):
                done.append(index)
                result.events.append(("Normal", "RolloutWorldDone", f"world {index} runs the new spec"))
                continue
            age = (now - parse_time(entry["since"])).total_seconds()
            if world.phase == "Failed" or age > drain_timeout + startup_timeout:
                failed = {
                    "world": index,
                    "message": f"world {index} did not become Ready on the new spec ({world.phase})",
                }
                result.events.append(("Warning", "RolloutFailed", failed["message"]))
                continue
            in_flight.append(entry)
            continue
        if step == "draining":
            age = (now - parse_time(entry.get("drainingSince", entry["since"]))).total_seconds()
            if world.admission == "parked" or world.phase not in ANSWERING or age > drain_timeout + 30:
                entry = {**entry, "step": "replacing"}
                result.orders.append((index, "replace"))
            elif not world.busy and world.admission == "running":
                result.orders.append((index, "drain"))
        elif step == "replacing":
            result.orders.append((index, "replace"))
        elif step == "swapping" and not world.busy:
            if world.admission == "parked":
                result.orders.append((index, "swap-wake"))
            elif world.admission == "running":
                result.orders.append((index, "swap-sleep"))
        in_flight.append(entry)

    if failed is None:
        taken = {entry["world"] for entry in in_flight}
        waiting = [
            world
            for world in worlds
            if world.outdated and world.index not in taken and world.index not in done
        ]
        unavailable = sum(1 for world in worlds if out_of_service(world))
        # Worlds that serve nothing anyway first: replacing them costs no availability.
        for world in sorted(waiting, key=lambda world: (world.phase not in DOWN, world.index)):
            if world.phase in DOWN and world.outdated != "model":
                in_flight.append({"world": world.index, "step": "replacing", "since": format_time(now)})
                result.orders.append((world.index, "replace"))
                continue
            if unavailable >= max_unavailable:
                break
            unavailable += 0 if out_of_service(world) else 1
            if world.outdated == "model":
                in_flight.append({"world": world.index, "step": "swapping", "since": format_time(now)})
                if world.admission == "parked":
                    result.orders.append((world.index, "swap-wake"))
                elif world.admission == "running" and not world.busy:
                    result.orders.append((world.index, "swap-sleep"))
            else:
                in_flight.append(
                    {
                        "world": world.index,
                        "step": "draining",
                        "since": format_time(now),
                        "drainingSince": format_time(now),
                    }
                )
                if world.admission == "running" and not world.busy:
                    result.orders.append((world.index, "drain"))
                else:
                    in_flight[-1]["step"] = "replacing"
                    result.orders.append((world.index, "replace"))
            result.events.append(
                ("Normal", "RolloutWorld", f"world {world.index}: {in_flight[-1]['step']} for the new spec")
            )

    new = {"target": target, "done": sorted(set(done)), "inFlight": in_flight}
    if failed is not None:
        new["failed"] = failed
    if not outdated and not in_flight:
        new["complete"] = True
        if not memory.get("complete") and new["done"]:
            result.events.append(("Normal", "RolloutComplete", f"every world runs {target}"))
    result.memory = new
    return result
