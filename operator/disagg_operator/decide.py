"""The planner's decision (pure): signals + current replicas + recent recommendations → desired
prefill and decode replicas, with the reasons (docs/autoscaling.md).

1. **Recommend** each pool's size from its signals, as an HPA does: the largest ratio of a signal to
   its target, times the current size, rounded up (prefill: TTFT and waiting requests per pod;
   decode: ITL and KV-cache usage). Signals within ``tolerance`` of their target, or none at all,
   keep the current size.
2. Clamp to the pool's bounds and **hold the ratio** prefill/decode within its bounds, by raising
   the smaller side first (only at a bound is the other side lowered).
3. **Stabilise** against the recommendations of the windows: scale up only to the lowest
   recommendation of the scale-up window, down only to the highest of the scale-down window. So a
   pool that grew does not shrink before a whole scale-down window of lower recommendations.
4. Hold the ratio again on the result (the two pools stabilise separately); a size raised for the
   ratio is remembered as that pool's recommendation, so it is not undone before its window ends.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from disagg_operator.spec import AutoscalingSpec

PREFILL, DECODE = "prefill", "decode"


@dataclass(frozen=True)
class Signals:
    """One reading of the model's engines; None: not available (no pod answered, no samples yet)."""

    ttft_p90: float | None = None  # seconds, prefill engines (decode's when prefill is off)
    waiting: float | None = None  # requests waiting in the prefill engines' queues, all pods together
    itl_p90: float | None = None  # seconds, decode engines
    kv_usage: float | None = None  # mean KV-cache usage of the decode engines, 0-1


@dataclass(frozen=True)
class Replicas:
    prefill: int | None  # None: the model has no prefill pool (decode prefills)
    decode: int


@dataclass(frozen=True)
class Recommendation:
    at: float  # seconds (monotonic or epoch: only differences matter)
    prefill: int | None
    decode: int
    found: bool = False  # the sizes found when the planner started: they only hold off scaling down


@dataclass(frozen=True)
class Decision:
    replicas: Replicas
    history: tuple[Recommendation, ...]  # what the next decision needs (pass it back as ``history``)
    reasons: dict[str, str] = field(default_factory=dict)  # pool -> why it is (or stays) at its size
    ratio_held: bool = False  # the ratio bounds changed a size


def _size(current: int, ratios: Sequence[tuple[str, float]], tolerance: float) -> tuple[int, str]:
    """(recommended size, reason) from (description, observed/target) pairs."""
    if not ratios:
        return current, "no signals: size kept"
    name, ratio = max(ratios, key=lambda r: r[1])
    if abs(ratio - 1) <= tolerance:
        return current, f"{name} within {tolerance:.0%} of its target"
    return max(1, math.ceil(current * ratio - 1e-9)), f"{name} at {ratio:.2f}x its target"


def _ratios(spec: AutoscalingSpec, s: Signals, prefill: int | None) -> tuple[list, list]:
    t, pre, dec = spec.targets, [], []
    if t.ttft_seconds is not None and s.ttft_p90 is not None:
        (pre if prefill is not None else dec).append(
            (f"TTFT p90 {s.ttft_p90:.3g}s (target {t.ttft_seconds:g}s)", s.ttft_p90 / t.ttft_seconds))
    if t.waiting_per_prefill_pod is not None and s.waiting is not None and prefill:
        per_pod = s.waiting / prefill
        pre.append((f"waiting {per_pod:.3g}/prefill pod (target {t.waiting_per_prefill_pod:g})",
                    per_pod / t.waiting_per_prefill_pod))
    if t.itl_seconds is not None and s.itl_p90 is not None:
        dec.append((f"ITL p90 {s.itl_p90:.3g}s (target {t.itl_seconds:g}s)", s.itl_p90 / t.itl_seconds))
    if t.decode_kv_cache_usage is not None and s.kv_usage is not None:
        dec.append((f"KV-cache usage {s.kv_usage:.0%} (target {t.decode_kv_cache_usage:.0%})",
                    s.kv_usage / t.decode_kv_cache_usage))
    return pre, dec


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


def hold_ratio(spec: AutoscalingSpec, prefill: int, decode: int) -> tuple[int, int]:
    """The sizes within the bounds whose prefill/decode is within the ratio bounds that lower the pools
    least, then raise them least (raising the smaller side before lowering the other). When no such
    integer sizes exist (e.g. ratio 0.5-0.5 with 3 decode pods at most), the sizes clamped to the bounds."""
    r, p_b, d_b = spec.ratio, spec.prefill, spec.decode
    best: tuple[tuple[int, int], tuple[int, int]] | None = None
    for d in range(d_b.min_replicas, d_b.max_replicas + 1):
        low = max(p_b.min_replicas, math.ceil(d * r.min - 1e-9))
        high = min(p_b.max_replicas, math.floor(d * r.max + 1e-9))
        if low > high:
            continue
        p = _clamp(prefill, low, high)
        cost = (max(0, prefill - p) + max(0, decode - d), max(0, p - prefill) + max(0, d - decode))
        if best is None or cost < best[0]:
            best = (cost, (p, d))
    if best is None:
        return _clamp(prefill, p_b.min_replicas, p_b.max_replicas), _clamp(decode, d_b.min_replicas, d_b.max_replicas)
    return best[1]


def _stabilise(current: int, now: float, recs: Sequence[tuple[float, int, bool]], up: float, down: float) -> int:
    upward = min(v for at, v, found in recs if now - at <= up and not found)
    downward = max(v for at, v, _ in recs if now - at <= down)
    if upward > current:
        return upward
    if downward < current:
        return downward
    return current


def decide(spec: AutoscalingSpec, signals: Signals, current: Replicas, history: Sequence[Recommendation],
           now: float) -> Decision:
    """The sizes the pools should have now (see the module's docstring)."""
    pre_ratios, dec_ratios = _ratios(spec, signals, current.prefill)
    d_raw, d_why = _size(current.decode, dec_ratios, spec.tolerance)
    d_rec = _clamp(d_raw, spec.decode.min_replicas, spec.decode.max_replicas)
    reasons = {DECODE: d_why}
    p_rec: int | None = None
    alone: dict[str, int] = {}  # what the signals alone recommend, where the ratio changed it
    if current.prefill is not None:
        p_raw, reasons[PREFILL] = _size(current.prefill, pre_ratios, spec.tolerance)
        p_signal, d_signal = _clamp(p_raw, spec.prefill.min_replicas, spec.prefill.max_replicas), d_rec
        p_rec, d_rec = hold_ratio(spec, p_signal, d_signal)
        alone = {pool: signal for pool, signal, held in ((PREFILL, p_signal, p_rec), (DECODE, d_signal, d_rec))
                 if signal != held}
    rec = Recommendation(now, p_rec, d_rec)
    # No history (the planner just started): the current sizes count as recommended now, so nothing
    # shrinks before a whole scale-down window of readings.
    recent = [*(history or [Recommendation(now, current.prefill, current.decode, found=True)]), rec]
    up, down = spec.stabilization.scale_up_seconds, spec.stabilization.scale_down_seconds

    decode = _clamp(_stabilise(current.decode, now, [(r.at, r.decode, r.found) for r in recent], up, down),
                    spec.decode.min_replicas, spec.decode.max_replicas)
    if current.prefill is None:
        final = Replicas(None, decode)
        return Decision(final, _kept(spec, recent, now), _explain(reasons, current, final))
    prefill = _clamp(_stabilise(current.prefill, now, [(r.at, r.prefill, r.found) for r in recent if r.prefill is not None],
                                up, down), spec.prefill.min_replicas, spec.prefill.max_replicas)
    held_p, held_d = hold_ratio(spec, prefill, decode)
    alone |= {pool: before for pool, before, after in ((PREFILL, prefill, held_p), (DECODE, decode, held_d))
              if before != after and pool not in alone}
    final = Replicas(held_p, held_d)
    # The ratio decided a size: it differs from what the signals alone would have made it.
    alone = {pool: v for pool, v in alone.items() if getattr(final, pool) != v}
    ratio_held = bool(alone)
    # What the ratio raised stays raised for a whole window, as if recommended.
    recent[-1] = replace(rec, prefill=max(p_rec or 0, held_p) if held_p > prefill else p_rec,
                         decode=max(d_rec, held_d) if held_d > decode else d_rec)
    reasons = _explain(reasons, current, final)
    for pool, before in alone.items():
        reasons[pool] = (f"ratio bounds {spec.ratio.min:g}-{spec.ratio.max:g} prefill per decode pod hold it at "
                         f"{getattr(final, pool)} (signals alone: {before}; {reasons[pool]})")
    return Decision(final, _kept(spec, recent, now), reasons, ratio_held)


def _explain(reasons: dict[str, str], current: Replicas, final: Replicas) -> dict[str, str]:
    out = dict(reasons)
    for pool, before, after in ((PREFILL, current.prefill, final.prefill), (DECODE, current.decode, final.decode)):
        if pool in out and before is not None and after is not None and before == after and "within" not in out[pool] \
                and "no signals" not in out[pool]:
            out[pool] += "; held by the stabilisation window or the bounds"
    return out


def _kept(spec: AutoscalingSpec, history: Sequence[Recommendation], now: float) -> tuple[Recommendation, ...]:
    """The recommendations a later decision can still need."""
    keep = max(spec.stabilization.scale_up_seconds, spec.stabilization.scale_down_seconds)
    return tuple(r for r in history if now - r.at <= keep)


def surge_step(spec: AutoscalingSpec, target: Replicas, current: Replicas, ready: Replicas) -> Replicas:
    """The sizes to set now on the way to ``target`` (both pools together): a pool grows only as far as
    the other pool's *ready* pods keep the ratio (prefill <= ready decode x max, decode <= ready prefill /
    min), so while new pods come up the ready pods stay within the ratio bounds; the next step follows
    once they are ready. A pool shrinks only as far as the other pool's size keeps the ratio (decode >=
    prefill / max, prefill >= decode x min): the other shrinks first (prefill may take several decisions
    to retire its pods, ``retire.py``). When every pod is ready and still neither pool may move by itself
    (a tight ratio such as min = max), both move to the next sizes within the ratio at once. A model
    without prefill: at once."""
    if target.prefill is None or current.prefill is None or ready.prefill is None:
        return target
    r = spec.ratio
    p, d = target.prefill, target.decode
    if p > current.prefill:
        p = max(current.prefill, min(p, math.floor(ready.decode * r.max + 1e-9)))
    if d > current.decode and r.min > 0:
        d = max(current.decode, min(d, math.floor(ready.prefill / r.min + 1e-9)))
    # The other pool's pods as they will be after this step (a growing pool's count them already).
    if p < current.prefill and r.min > 0:
        p = min(current.prefill, max(p, math.ceil(max(d, current.decode) * r.min - 1e-9)))
    if d < current.decode:
        d = min(current.decode, max(d, math.ceil(max(p, current.prefill) / r.max - 1e-9)))
    if (p, d) != (current.prefill, current.decode) or target == current:
        return Replicas(p, d)
    grows = target.prefill > current.prefill or target.decode > current.decode
    if grows and not (ready.prefill >= current.prefill and ready.decode >= current.decode):
        return current
    return _joint_step(spec, target, current)


def decode_beside(spec: AutoscalingSpec, prefill: int, before: int, after: int) -> int:
    """Decode's size for this decision when prefill stays at ``prefill`` for now (its pods still leaving
    the sidecars' selection): decode shrinks only as far as that many prefill pods keep ``ratio.max``
    (what ``surge_step`` leaves to a joint step of both pools waits for prefill)."""
    if after >= before:
        return after
    return min(before, max(after, math.ceil(prefill / spec.ratio.max - 1e-9)))


def _joint_step(spec: AutoscalingSpec, target: Replicas, current: Replicas) -> Replicas:
    """The sizes between ``current`` and ``target`` nearest to ``current`` (growing: the smallest,
    shrinking: the largest) where both pools moved and the ratio holds."""
    assert target.prefill is not None and current.prefill is not None
    r = spec.ratio

    def towards(now: int, goal: int) -> range:
        return range(now, goal + 1) if goal >= now else range(now, goal - 1, -1)
    for d in towards(current.decode, target.decode):
        for p in towards(current.prefill, target.prefill):
            if (p, d) != (current.prefill, current.decode) and r.min * d - 1e-9 <= p <= r.max * d + 1e-9:
                return Replicas(p, d)
    return target
