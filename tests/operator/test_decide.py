"""The planner's decision function (operator/disagg_operator/decide.py): tables for each step, and
properties over random signal traces (no flapping inside the windows, ratio held, bounds respected)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest

from disagg_operator.decide import Recommendation, Replicas, Signals, decide, decode_beside, hold_ratio, surge_step
from disagg_operator.spec import AutoscalingSpec


def spec(**overrides: object) -> AutoscalingSpec:
    base: dict[str, object] = {
        "prefill": {"minReplicas": 1, "maxReplicas": 8}, "decode": {"minReplicas": 1, "maxReplicas": 8},
        "ratio": {"min": 0.5, "max": 2}, "targets": {"ttftSeconds": 0.5, "waitingPerPrefillPod": 4,
                                                      "itlSeconds": 0.05, "decodeKvCacheUsage": 0.8},
        "stabilization": {"scaleUpSeconds": 0, "scaleDownSeconds": 60},
    }
    return AutoscalingSpec.model_validate({**base, **overrides})


IDLE = Signals(ttft_p90=0.1, waiting=0, itl_p90=0.01, kv_usage=0.1)


# --- one decision --------------------------------------------------------------------------------

@pytest.mark.parametrize("signals,current,want,why", [
    # 12 waiting over 2 prefill pods = 6 per pod against 4: 1.5x → 3 pods.
    (Signals(waiting=12), Replicas(2, 2), Replicas(3, 2), "waiting 6/prefill pod"),
    # TTFT 1.5 s against 0.5 s: 3x the one prefill pod; ratio max 2 pulls decode up to 2.
    (Signals(ttft_p90=1.5), Replicas(1, 1), Replicas(3, 2), "TTFT p90 1.5s"),
    # KV usage 0.96 against 0.8: 1.2x of 4 decode pods → 5 (4.8 rounded up); ratio min 0.5 → prefill 3.
    (Signals(kv_usage=0.96), Replicas(2, 4), Replicas(3, 5), "KV-cache usage 96%"),
    # ITL within 10% of target, nothing else: sizes kept.
    (Signals(itl_p90=0.054), Replicas(2, 2), Replicas(2, 2), "within 10%"),
    # No signals at all (nothing scraped yet): sizes kept.
    (Signals(), Replicas(2, 3), Replicas(2, 3), "no signals"),
    # The largest ratio of a pool decides: ITL 2x beats KV 0.5x.
    (Signals(itl_p90=0.1, kv_usage=0.4), Replicas(2, 2), Replicas(2, 4), "ITL p90"),
    # Bounds: 40 waiting per pod wants 10, max is 8; ratio max 2 then wants decode 4.
    (Signals(waiting=40), Replicas(1, 1), Replicas(8, 4), "waiting 40/prefill pod"),
])
def test_a_decision_without_history(signals: Signals, current: Replicas, want: Replicas, why: str) -> None:
    d = decide(spec(), signals, current, [], now=0)
    assert d.replicas == want
    pool = "prefill" if signals.waiting is not None or signals.ttft_p90 is not None else "decode"
    assert why in d.reasons[pool]


def test_decode_only_models_scale_decode_and_read_ttft_from_it() -> None:
    d = decide(spec(), Signals(ttft_p90=1.0), Replicas(None, 2), [], now=0)
    assert d.replicas == Replicas(None, 4) and "TTFT" in d.reasons["decode"] and "prefill" not in d.reasons


@pytest.mark.parametrize("ratio,pre,dec,want", [
    ({"min": 0.5, "max": 2}, 1, 4, (2, 4)),  # too few prefill pods: prefill raised
    ({"min": 0.5, "max": 2}, 6, 2, (6, 3)),  # too many: decode raised
    ({"min": 1, "max": 1}, 8, 3, (8, 8)),  # 1:1, decode raised to meet prefill
    ({"min": 2, "max": 4}, 8, 5, (8, 4)),  # prefill at its max 8: decode lowered to 8 / 2
])
def test_hold_ratio(ratio: dict[str, float], pre: int, dec: int, want: tuple[int, int]) -> None:
    assert hold_ratio(spec(ratio=ratio), pre, dec) == want


def test_a_scale_down_waits_for_a_whole_window_of_lower_recommendations() -> None:
    s, history, current = spec(), (), Replicas(4, 4)
    for t in range(0, 61, 15):  # idle for 60 s: every recommendation says 1, the window still holds 4
        d = decide(s, IDLE, current, history, now=t)  # (the first: the sizes found count as recommended)
        history = d.history
        assert d.replicas == current, t
    history = [Recommendation(0, 4, 4), *(Recommendation(t, 1, 1) for t in range(15, 61, 15))]
    assert decide(s, IDLE, current, history, now=75).replicas == Replicas(1, 1)  # the 4 left the window


# --- properties over random traces ----------------------------------------------------------------

@dataclass
class Step:
    at: float
    before: Replicas
    after: Replicas


def random_spec(rng: random.Random) -> AutoscalingSpec:
    while True:
        p_min, d_min = rng.randint(1, 3), rng.randint(1, 3)
        r_min = rng.choice([0, 0.25, 0.5, 1])
        r_max = max(r_min, rng.choice([0.5, 1, 2, 4])) or 1
        raw = {"prefill": {"minReplicas": p_min, "maxReplicas": p_min + rng.randint(0, 8)},
               "decode": {"minReplicas": d_min, "maxReplicas": d_min + rng.randint(0, 8)},
               "ratio": {"min": r_min, "max": r_max},
               "targets": {"ttftSeconds": 0.5, "waitingPerPrefillPod": 4, "itlSeconds": 0.05, "decodeKvCacheUsage": 0.8},
               "stabilization": {"scaleUpSeconds": rng.choice([0, 0, 30]), "scaleDownSeconds": rng.choice([0, 60, 300])},
               "tolerance": rng.choice([0, 0.1, 0.2])}
        try:
            return spec(**raw)
        except ValueError:  # infeasible ratio for those bounds: the rules refuse it, draw again
            continue


def random_trace(rng: random.Random, length: int) -> list[Signals]:
    """Load that drifts, bursts and drops; sometimes a signal is missing (a scrape failed)."""
    load, out = rng.uniform(0, 2), []
    for _ in range(length):
        load = max(0.0, load * rng.uniform(0.7, 1.4) + (rng.uniform(2, 6) if rng.random() < 0.05 else 0))
        if rng.random() < 0.05:
            load = 0.0

        def maybe(value: float) -> float | None:
            return None if rng.random() < 0.1 else value
        out.append(Signals(ttft_p90=maybe(0.5 * load * rng.uniform(0.8, 1.2)), waiting=maybe(4 * load * rng.uniform(0, 3)),
                           itl_p90=maybe(0.05 * load * rng.uniform(0.8, 1.2)), kv_usage=maybe(min(1.0, 0.8 * load * rng.uniform(0.8, 1.2)))))
    return out


def run(s: AutoscalingSpec, trace: list[Signals], start: Replicas, interval: float) -> list[Step]:
    history: tuple[Recommendation, ...] = ()
    current, steps = start, []
    for i, signals in enumerate(trace):
        now = i * interval
        d = decide(s, signals, current, history, now)
        history = d.history
        steps.append(Step(now, current, d.replicas))
        current = d.replicas
    return steps


def feasible(s: AutoscalingSpec) -> bool:
    """Some integer sizes within the bounds meet the ratio bounds."""
    return any(s.ratio.min - 1e-9 <= p / d <= s.ratio.max + 1e-9
               for p in range(s.prefill.min_replicas, s.prefill.max_replicas + 1)
               for d in range(s.decode.min_replicas, s.decode.max_replicas + 1))


@pytest.mark.parametrize("seed", range(300))
def test_properties_over_random_traces(seed: int) -> None:
    rng = random.Random(seed)
    s = random_spec(rng)
    start = Replicas(rng.randint(1, 12), rng.randint(1, 12))  # may start outside the bounds (a spec edit)
    steps = run(s, random_trace(rng, 120), start, interval=rng.choice([5, 15, 30]))
    for step in steps:
        p, d = step.after.prefill, step.after.decode
        assert p is not None
        assert s.prefill.min_replicas <= p <= s.prefill.max_replicas, step
        assert s.decode.min_replicas <= d <= s.decode.max_replicas, step
        if feasible(s):
            assert s.ratio.min - 1e-9 <= p / d <= s.ratio.max + 1e-9, step
    up, down = s.stabilization.scale_up_seconds, s.stabilization.scale_down_seconds
    for pool in ("prefill", "decode"):
        moves = [(st.at, getattr(st.after, pool) - getattr(st.before, pool)) for st in steps[1:]
                 if getattr(st.after, pool) != getattr(st.before, pool)]
        for (t1, m1), (t2, m2) in zip(moves, moves[1:]):
            if m1 > 0 and m2 < 0:
                assert t2 - t1 > down, f"{pool} grew at {t1} and shrank at {t2} within the {down}s window"
            if m1 < 0 and m2 > 0:
                assert t2 - t1 > up, f"{pool} shrank at {t1} and grew at {t2} within the {up}s window"


def test_sustained_load_reaches_the_bounds_and_idle_returns_to_the_minimum() -> None:
    s = spec(stabilization={"scaleUpSeconds": 0, "scaleDownSeconds": 60})
    hot = Signals(ttft_p90=2.0, waiting=100, itl_p90=0.2, kv_usage=1.0)
    steps = run(s, [hot] * 8 + [IDLE] * 12, Replicas(1, 1), interval=15)
    assert steps[3].after == Replicas(8, 8)  # doubling+ per step from 1 reaches the maxima
    peak = max(i for i, st in enumerate(steps) if st.after == Replicas(8, 8))
    assert steps[-1].after == Replicas(1, 1)
    first_down = next(st.at for st in steps[peak:] if st.after.decode < 8)
    assert first_down - steps[7].at > 60  # the last hot recommendation had to leave the window


def test_a_size_the_ratio_decided_says_so() -> None:
    # Prefill grows to 3 on its queue; decode's own signal (KV 10%) wants 1, the ratio max 1 needs 3.
    s = spec(ratio={"min": 0.5, "max": 1})
    d = decide(s, Signals(waiting=40, kv_usage=0.1), Replicas(1, 1), (), now=0)
    assert d.replicas == Replicas(8, 8) and d.ratio_held
    assert d.reasons["decode"].startswith("ratio bounds 0.5-1") and "signals alone: 1" in d.reasons["decode"]
    assert "ratio" not in d.reasons["prefill"]
    # Held there on the next reading: still the ratio's doing, and said so.
    again = decide(s, Signals(waiting=40, kv_usage=0.1), d.replicas, d.history, now=15)
    assert again.replicas == Replicas(8, 8) and again.ratio_held and "ratio bounds" in again.reasons["decode"]
    # Without a ratio bound in the way, nothing is said about it.
    free = decide(spec(ratio={"min": 0, "max": 100}), Signals(waiting=40, kv_usage=0.1), Replicas(1, 1), (), now=0)
    assert not free.ratio_held and "ratio" not in free.reasons["decode"]


# --- surging both pools together (surge_step) ------------------------------------------------------

@pytest.mark.parametrize("ratio,target,current,ready,want", [
    # ratio 0.5-1 from (1, 1) to (3, 3): decode may double on 1 ready prefill pod, prefill waits for decode.
    ({"min": 0.5, "max": 1}, (3, 3), (1, 1), (1, 1), (1, 2)),
    ({"min": 0.5, "max": 1}, (3, 3), (1, 2), (1, 1), (1, 2)),  # the new decode pod not ready yet: wait
    ({"min": 0.5, "max": 1}, (3, 3), (1, 2), (1, 2), (2, 2)),
    ({"min": 0.5, "max": 1}, (3, 3), (2, 2), (2, 2), (2, 3)),
    ({"min": 0.5, "max": 1}, (3, 3), (2, 3), (2, 3), (3, 3)),
    # min 0 (the default): decode is never held back by prefill.
    ({"min": 0, "max": 100}, (6, 8), (1, 1), (1, 1), (6, 8)),
    # A tight ratio (1-1) with every pod ready: both grow together, one pair at a time.
    ({"min": 1, "max": 1}, (3, 3), (1, 1), (1, 1), (2, 2)),
    ({"min": 1, "max": 1}, (3, 3), (2, 2), (1, 2), (2, 2)),  # a pod still coming up: wait
    # Shrinking: a pool goes only as far as the other pool's size keeps the ratio (the other goes first).
    ({"min": 0.5, "max": 1}, (1, 1), (2, 2), (2, 2), (1, 2)),  # 2 prefill on 1 decode: over max 1
    ({"min": 0.5, "max": 1}, (1, 1), (1, 2), (1, 2), (1, 1)),
    ({"min": 0.5, "max": 1}, (1, 1), (3, 3), (3, 3), (2, 3)),  # 1 prefill on 3 decode: under min 0.5
    ({"min": 0.5, "max": 1}, (1, 1), (2, 3), (2, 3), (2, 2)),
    ({"min": 0, "max": 100}, (1, 1), (6, 8), (6, 8), (1, 1)),  # no bound in the way: at once
    # A tight ratio: both shrink together, one pair at a time.
    ({"min": 1, "max": 1}, (1, 1), (3, 3), (3, 3), (2, 2)),
])
def test_surge_step(ratio, target, current, ready, want) -> None:
    s = spec(ratio=ratio)
    assert surge_step(s, Replicas(*target), Replicas(*current), Replicas(*ready)) == Replicas(*want)


def smallest_and_largest(s: AutoscalingSpec, rng: random.Random) -> tuple[Replicas, Replicas] | None:
    """Sizes within the bounds and the ratio with the fewest and the most pods (None: there are none)."""
    pairs = [(p, d) for p in range(s.prefill.min_replicas, s.prefill.max_replicas + 1)
             for d in range(s.decode.min_replicas, s.decode.max_replicas + 1)
             if s.ratio.min - 1e-9 <= p / d <= s.ratio.max + 1e-9]
    if not pairs:
        return None
    return (Replicas(*min(pairs, key=lambda pd: (pd[0] + pd[1], rng.random()))),
            Replicas(*max(pairs, key=lambda pd: (pd[0] + pd[1], rng.random()))))


@pytest.mark.parametrize("seed", range(200))
def test_ready_pods_hold_the_ratio_while_both_pools_surge(seed: int) -> None:
    """From sizes within the ratio to a target within it: pods come up one at a time in random order
    between the planner's steps; the ready pods' ratio stays within bounds (except while a tight ratio
    makes both pools grow at once) and the target is reached."""
    rng = random.Random(seed)
    s = random_spec(rng)
    if (ends := smallest_and_largest(s, rng)) is None:
        return
    start, target = ends
    current = ready = start
    for _ in range(200):
        if ready == target:
            break
        step = surge_step(s, target, current, ready)
        # Beyond what the other pool's ready pods allow: both grow at once (a tight ratio) ...
        joint = step.prefill > max(current.prefill, math.floor(ready.decode * s.ratio.max + 1e-9)) or (
            s.ratio.min > 0 and step.decode > max(current.decode, math.floor(ready.prefill / s.ratio.min + 1e-9)))
        if joint:  # ... only once every pod is ready, and where growing one pool alone would leave the ratio
            assert ready == current, (current, ready, step)
            for p, d in ((current.prefill + 1, current.decode), (current.prefill, current.decode + 1)):
                assert not (p <= target.prefill and d <= target.decode and s.ratio.min - 1e-9 <= p / d <= s.ratio.max + 1e-9), (
                    current, step)
        assert current.prefill <= step.prefill <= target.prefill and current.decode <= step.decode <= target.decode
        current = step
        while ready != current:  # the new pods become ready, one at a time, in any order
            pools = [pool for pool in ("prefill", "decode") if getattr(ready, pool) < getattr(current, pool)]
            pool = rng.choice(pools)
            ready = Replicas(ready.prefill + (pool == "prefill"), ready.decode + (pool == "decode"))
            if not joint:
                assert s.ratio.min - 1e-9 <= ready.prefill / ready.decode <= s.ratio.max + 1e-9, (current, ready)
    assert ready == target, f"stuck at {ready} on the way to {target}"


@pytest.mark.parametrize("seed", range(200))
def test_sizes_hold_the_ratio_while_both_pools_shrink(seed: int) -> None:
    """From sizes within the ratio to a smaller target within it: prefill's scale-down waits a random
    number of decisions (its pods leave the sidecars' selection first, retire.py), decode's is at once;
    every size the Deployments pass through holds the ratio (except while a tight ratio makes both pools
    shrink at once) and the target is reached."""
    rng = random.Random(seed)
    s = random_spec(rng)
    if (ends := smallest_and_largest(s, rng)) is None:
        return
    target, start = ends
    within = lambda r: s.ratio.min - 1e-9 <= r.prefill / r.decode <= s.ratio.max + 1e-9  # noqa: E731
    current = start
    for _ in range(400):
        if current == target:
            break
        step = surge_step(s, target, current, current)
        assert target.prefill <= step.prefill <= current.prefill and target.decode <= step.decode <= current.decode
        joint = step.prefill < current.prefill and step.decode < current.decode and not within(
            Replicas(step.prefill, current.decode))
        if rng.random() < 0.5:  # prefill's pods still leaving: it stays, decode goes only as far as that allows
            prefill, decode = current.prefill, decode_beside(s, current.prefill, current.decode, step.decode)
            sizes = [Replicas(prefill, decode)]
        else:  # the planner scales prefill first
            prefill, decode = step.prefill, step.decode
            sizes = [Replicas(prefill, current.decode), Replicas(prefill, decode)]
        assert all(joint or within(size) for size in sizes), (current, step, sizes)
        current = Replicas(prefill, decode)
    assert current == target, f"stuck at {current} on the way to {target}"
